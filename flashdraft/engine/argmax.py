"""`argmax(x)`: `x.argmax(dim=-1)`, through numpy on CPU.

torch's CPU argmax over the last dimension is not vectorised: on the AMD EPYC our benchmarks run on (one thread) it
takes ~110 us for a drafted block's logits [1, 15, 8192] in fp32 and ~450 us in bf16, where numpy's takes ~10 us
(~25 us with the bf16 -> fp32 copy). A draft step of the default pair took ~3.2 ms, so the draft's argmax alone was
14 % of it; the verifier's over a 4-row block [4, 16, 8192] took ~530 us against ~40 us. Both return the index of
the first maximal value (a NaN counts as the maximum in both), so the choice is identical, token for token.

What this module does not know about: GPUs (torch's argmax is kept there), autograd, and graphs being compiled
(`torch.compile` keeps torch's argmax: a numpy call would break the graph).
"""

from __future__ import annotations

import numpy as np
import torch

# below this many elements torch's own argmax is as fast as the round trip through numpy
NUMPY_FROM_ELEMENTS = 4096


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Indices [...] (int64, on x's device) of the first maximum of each row of x [..., n]."""
    if (x.device.type != "cpu" or x.numel() < NUMPY_FROM_ELEMENTS or x.requires_grad or x.is_complex()
            or torch.compiler.is_compiling()):
        return x.argmax(dim=-1)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # numpy has no bf16; fp16 -> fp32 and bf16 -> fp32 are exact, so the order is kept
    return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))
