"""Linear layers through oneDNN with a weight packed once, for inference on CPU.

On CPU torch sends a dense matmul to MKL, whose small-M GEMMs are slow on some processors. On the AMD EPYC our
benchmarks run on, a 16-row fp32 projection 256 -> 8192 (a 16-token verify's lm_head on the default pair) takes
~1.7 ms through MKL and ~0.35 ms through oneDNN with the weight reordered once into oneDNN's blocked layout; the
MLP's 256 <-> 768 projections gain 1.2-1.6x, q/k/v fused into one 256 -> 512 projection 1.4x. Speculative
decoding is full of such GEMMs (16 positions per row).

`PackedLinear(weight, bias)` computes `F.linear(x, weight, bias)` through `torch.ops.mkldnn._linear_pointwise` on
the packed copy, wrapped as a custom op so `torch.compile` keeps it as one opaque call. `packed_linear(module)`
gives the twin of one `nn.Linear` (the module is untouched; its `.weight`/`.bias` stay reachable through the twin).

What this module does not know about: GPUs (nothing here runs there), dtypes other than fp32 and bf16, autograd
(inference only: a packed copy does not follow later changes to the weight), and bitwise equality with MKL:
results differ in the last bits (another summation order), like any change of GEMM kernel or of rows per call.
Single small projections (<= ~256 x 256) are as fast or faster through MKL; callers pack the wide ones. Which
path is faster depends on the processor, so the default (`pack_by_default`) times both on the weights first.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# packing copies weights, so callers that pack on their own accord keep the copies under this size
AUTO_PACK_BUDGET_BYTES = 2 << 30


@torch.library.custom_op("flashdraft::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def native_bf16_cpu() -> bool:
    """True if this CPU multiplies bf16 natively (AVX512-BF16 / AMX), where bf16 matmuls beat fp32 several times;
    oneDNN packs bf16 weights only on such CPUs (or AVX512BW/VL/DQ, AVX-NE-CONVERT ones), not on AVX2-only ones."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (weight.dtype != torch.bfloat16 or native_bf16_cpu()))


def require_packable(weights: list[torch.Tensor]) -> None:
    bad = sorted({f"{w.dtype} on {w.device}" for w in weights if not can_pack(w)})
    if bad:
        raise ValueError(f"pack_weights=True needs fp32 weights on a CPU with oneDNN, or bf16 ones on a CPU whose "
                         f"oneDNN multiplies bf16 (AVX512 or AMX), got {', '.join(bad)}")


def pack_by_default(weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 16)) -> bool:
    """Whether packed copies of `weights` are a good default: all packable, their copies within budget, and
    faster than torch's own linear on this machine at `rows` rows per call (`packing_pays`)."""
    size = sum(w.numel() * w.element_size() for w in weights)
    return all(can_pack(w) for w in weights) and size <= AUTO_PACK_BUDGET_BYTES and packing_pays(weights, rows)


_PACKING_PAYS: dict[tuple, bool] = {}


def packing_pays(weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 16), margin: float = 0.95) -> bool:
    """Whether the packed oneDNN path computes `weights`' projections faster than torch's default linear here:
    each distinct shape and dtype timed at each of `rows` rows (by default 1 and 16: a one-token step and a block
    verify; a drafter's read-out: its block), the two paths' calls interleaved, weighted by how many weights share
    the shape; packed must take at most `margin` of the time. Measured, not assumed: on the AMD EPYC of our first
    benchmarks oneDNN was 1.2-5x faster on these shapes, on an AMX-capable Xeon MKL was faster (plain decoding of
    the default pair 316 tok/s packed, 422 not) for the fp32 target and slower for the bf16 drafter's read-out (16
    rows 8192 x 256: 378 us, packed 278 us). Cached per shapes, rows and thread count; ~0.15 s for the default
    pair."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault((tuple(w.shape), w.dtype), []).append(w)
    # dtypes do not order: the key names them, so one shape in two dtypes still sorts
    key = (tuple(sorted((shape, str(dtype), len(v)) for (shape, dtype), v in groups.items())), tuple(rows),
           torch.get_num_threads())
    if key not in _PACKING_PAYS:
        packed_s = plain_s = 0.0
        with torch.inference_mode():
            for (shape, dtype), members in groups.items():
                weight = members[0]
                packed = PackedLinear(weight)
                for n in rows:
                    x = torch.randn(n, shape[1], dtype=dtype)
                    a, b = _interleaved_median_s(lambda: packed(x), lambda: torch.nn.functional.linear(x, weight))
                    packed_s += len(members) * a
                    plain_s += len(members) * b
        _PACKING_PAYS[key] = packed_s <= margin * plain_s
    return _PACKING_PAYS[key]


def _interleaved_median_s(first, second, reps: int = 15, budget_s: float = 0.05) -> tuple[float, float]:
    """Median seconds per call of two callables timed in alternation (after a warm-up call of each)."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    started = time.perf_counter()
    while len(times[0]) < reps or (len(times[0]) < 3 * reps and time.perf_counter() - started < budget_s):
        for fn, out in ((first, times[0]), (second, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        if len(times[0]) >= 3 and time.perf_counter() - started > 20 * budget_s:
            break  # big weights: a few calls decide
    return statistics.median(times[0]), statistics.median(times[1])


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` through oneDNN on a packed copy of `weight` (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 16):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        self.packed_bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x.contiguous(), self.packed, self.packed_bias, self.out_features)


def packed_linear(linear: nn.Module) -> nn.Module:
    """The oneDNN twin of a CPU fp32/bf16 `nn.Linear` (sharing its parameters); anything else comes back unchanged."""
    if not isinstance(linear, nn.Linear) or not can_pack(linear.weight):
        return linear
    twin = PackedLinear(linear.weight, linear.bias)
    twin.weight, twin.bias = linear.weight, linear.bias  # the same parameters, for callers that read them
    return twin


def packed_concat(linears: list[nn.Linear]) -> PackedLinear:
    """One packed projection computing every linear of `linears` side by side (outputs concatenated)."""
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                          for m in linears])
    return PackedLinear(torch.cat([m.weight.detach() for m in linears]), bias)
