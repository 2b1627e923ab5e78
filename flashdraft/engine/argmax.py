"""Selections over the last dimension through numpy on CPU: `argmax(x)` (`x.argmax(dim=-1)`; `argmax_and_gap` also
the gap to the runner-up), `kth_largest` (the value `torch.topk` would end on), `sort_descending` (a row sort's
values) and `largest_sorted` (its first m, or all); and `fill_below`, the masking that follows them
(`x.masked_fill(x < cut, value)`).

torch's CPU argmax over the last dimension is not vectorised: on the AMD EPYC our benchmarks run on (one thread) it
takes ~110 us for a drafted block's logits [1, 15, 8192] in fp32 and ~450 us in bf16, where numpy's takes ~10 us
(~25 us with the bf16 -> fp32 copy). A draft step of the default pair took ~3.2 ms, so the draft's argmax alone was
14 % of it; the verifier's over a 4-row block [4, 16, 8192] took ~530 us against ~40 us. Both return the index of
the first maximal value (a NaN counts as the maximum in both), so the choice is identical, token for token.
torch's CPU sort is slower still: a verify's top-p over [16, 8192] float32 probabilities sorted in ~9 ms (one
thread, AMX Xeon), numpy's in ~0.5 ms; torch.topk's k-th value ~0.4 ms against numpy's partition ~0.25 ms; the m
largest of a row sorted after a partition take about half a whole sort at m = 1024 of 8192 (rows without zeros).
torch's comparison of rows against their cuts broadcast [n, 1] is not vectorised either: masking [16, 8192] below
a cut ~0.18 ms, through numpy ~0.09 ms. A sort's values, and the k-th largest value, do not depend on how tied
entries are ordered, so all are torch's exactly.

What this module does not know about: GPUs (torch's operations are kept there), autograd, and graphs being compiled
(`torch.compile` keeps torch's operations: a numpy call would break the graph).
"""

from __future__ import annotations

import numpy as np
import torch

# below this many elements torch's own argmax is as fast as the round trip through numpy
NUMPY_FROM_ELEMENTS = 4096


def _through_numpy(x: torch.Tensor) -> bool:
    return not (x.device.type != "cpu" or x.numel() < NUMPY_FROM_ELEMENTS or x.requires_grad or x.is_complex()
                or torch.compiler.is_compiling())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Indices [...] (int64, on x's device) of the first maximum of each row of x [..., n]."""
    if not _through_numpy(x):
        return x.argmax(dim=-1)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # numpy has no bf16; fp16 -> fp32 and bf16 -> fp32 are exact, so the order is kept
    return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))


def argmax_and_gap(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`argmax(x)`, the largest value of each row minus its second largest, in float32 [...]): two passes over a
    float32 copy of the rows through numpy on CPU (the largest masked, then the max), where a top-2 selection or a
    softmax costs 4-7x the argmax (~0.15 ms more for a drafted block's logits [1, 15, 8192])."""
    if not _through_numpy(x):
        top = x.float().topk(2, dim=-1).values
        return x.argmax(dim=-1), top[..., 0] - top[..., 1]
    a = x.float().numpy() if x.dtype != torch.float32 else x.numpy().copy()  # ours to mask
    ids = a.argmax(axis=-1)[..., None]
    first = np.take_along_axis(a, ids, axis=-1)
    np.put_along_axis(a, ids, -np.inf, axis=-1)
    return (torch.from_numpy(np.asarray(ids[..., 0], dtype=np.int64)),
            torch.from_numpy((first - a.max(axis=-1, keepdims=True))[..., 0]))


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row of x [..., n] (1 <= k <= n; equal values counted apart), as [..., 1]:
    `torch.topk(x, k, dim=-1).values[..., -1:]`, through numpy's partition on CPU for float32 / float64 rows."""
    if not _through_numpy(x) or x.dtype not in (torch.float32, torch.float64):
        return torch.topk(x, k, dim=-1).values[..., -1:]
    n = x.shape[-1]
    return torch.from_numpy(np.partition(x.numpy(), n - k, axis=-1)[..., n - k:n - k + 1].copy())


def sort_descending(x: torch.Tensor) -> torch.Tensor:
    """Each row of x [..., n] sorted, largest first (values only): `x.sort(dim=-1, descending=True).values`, through
    numpy's sort on CPU for float32 / float64 rows (NaN first in both)."""
    if not _through_numpy(x) or x.dtype not in (torch.float32, torch.float64):
        return x.sort(dim=-1, descending=True).values
    return torch.from_numpy(np.sort(x.numpy(), axis=-1)[..., ::-1].copy())


def largest_sorted(x: torch.Tensor, m: int) -> torch.Tensor:
    """The m largest values of each row of x [..., n], largest first, partitioned first through numpy on CPU so that
    only those m are sorted; where that does not pay, the whole rows sorted (`sort_descending(x)`, width n): other
    devices and dtypes, m >= n, and rows holding a value <= 0 (numpy's partition slows ~10x when a long run of equal
    values holds the split, as the zeros of probabilities under top-k or a low temperature do; its sort does not).
    Either way the first m columns are `sort_descending(x)[..., :m]`."""
    n = x.shape[-1]
    if m >= n or not _through_numpy(x) or x.dtype not in (torch.float32, torch.float64) or not x.numpy().min() > 0:
        return sort_descending(x)
    top = np.partition(x.numpy(), n - m, axis=-1)[..., n - m:]
    return torch.from_numpy(np.sort(top, axis=-1)[..., ::-1].copy())


def fill_below(x: torch.Tensor, cut: torch.Tensor, value: float) -> torch.Tensor:
    """`x.masked_fill(x < cut, value)` (cut broadcast over x [..., n], e.g. one per row [..., 1]), through numpy on
    CPU for float32 rows: entries below the cut become value, the rest (NaN included) stay."""
    if not _through_numpy(x) or x.dtype != torch.float32 or cut.dtype != torch.float32:
        return x.masked_fill(x < cut, value)
    a, c = x.numpy(), cut.numpy()
    if value == 0.0 and a.min() >= 0:  # probabilities: a product by the comparison, ~2x faster than np.where, the
        # same values (x >= 0: x * 1 = x, x * 0 = +0; a NaN anywhere fails the check)
        return torch.from_numpy(a * (a >= c))
    return torch.from_numpy(np.where(a < c, np.float32(value), a))
