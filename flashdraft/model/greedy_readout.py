"""The target's argmax (greedy rows, sampled rows' race) without full-precision logits: an fp32 lm_head screened
through a bf16 copy.

A greedy row needs one thing from the lm_head, the argmax of its logits, and so does a sampled row under the
default sampler: its token is the winner of an exponential race, argmax softmax(z / T) / E = argmax z - T log E
(`engine/noise.py`), the argmax of the logits plus known offsets. Yet a verify computes all V logits for
every position: on CPU in fp32 the read-out is the widest GEMM of the forward (the shipped target: 8192 x 256, 40 %
of its parameters; 16 positions 1.1-1.6 ms, 256 positions 9-13 ms on one core of an AMX Xeon, against 0.4-0.5 ms
and 1.5-3.5 ms in bf16). `ScreenedArgmax` computes the logits through a bf16 copy of the weight (fp32 accumulation,
as CPU kernels do), then certifies the choice. `bound` says how far a bf16 logit can be from the fp32 one: with x^,
w^ the inputs rounded to bf16 (u = 2^-8), w . x - w^ . x^ = w^ . (x - x^) + (w - w^) . x, at most
||w^|| ||x - x^|| + ||w - w^|| ||x|| by Cauchy-Schwarz (both differences known exactly), plus the two fp32 sums'
rounding and the bf16 result's u |z^|, times SAFETY. (1) Every token within twice the bound (largest weight norms)
of a row's bf16 maximum is a candidate; outside them no logit can reach the maximum. (2) Each candidate's own bound
drops those that cannot reach some other candidate's lowest value. (3) A row left with one takes it; a row left
with several gets their fp32 dot products and takes the largest, the lowest id among equals (as argmax does). So
the choice is the argmax of fp32 logits summed in another order than a full fp32 GEMM, as a GEMM of another row
count already is (greedy output still equals the target's own `generate`, which the tests check). Rows whose bf16
logits are not finite, calls of fewer than MIN_ROWS positions, and models whose logits leave most rows undecided
take the full fp32 read-out. With offsets (sampled rows' race) every step is the same on z + offsets: the bound is
on z, widened by the fp32 rounding of the sum, and the window's bf16 term is sized by the row's largest |z|, since a
candidate's logit need not be near the top's.

What this module does not know about: top-k / top-p and rejection sampling (they need the distribution: the full
read-out), GPUs (their lm_heads run in bf16 already), exact mode's per-token products (`fast_target.py` keeps
them), training.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flashdraft.model.cpu_linear import can_pack, native_bf16_cpu, packed_linear, packing_pays

UNIT_ROUNDOFF = 2.0 ** -8  # bf16: 8 significant bits, round to nearest
FLOAT32_ROUNDOFF = 2.0 ** -24
SAFETY = 1.5  # the certified window is this much wider than the derived bound: a looser bound only adds candidates
# fewer positions per call take the full read-out: one row's read-out is memory-bound and the screening's passes
# over the approximate logits cost more than the bf16 copy saves (1 row: 494 us against 421 on the AMX Xeon)
MIN_ROWS = 8
# undecided candidates in one call beyond which their rows take the full fp32 read-out instead of dot products
EXACT_CANDIDATES = 2048
# a model whose logits are flat (many tokens within the bound of the top) leaves most rows undecided, and the bf16
# pass is then wasted (hidden states made of embedding rows: 1.2-1.9x the full read-out's time). Where the moving
# share of undecided rows exceeds UNDECIDED_LIMIT the full read-out runs, the screening every REPROBE_EVERY-th call
# (the shipped target leaves 19 % of its rows undecided)
UNDECIDED_LIMIT, UNDECIDED_SMOOTHING, REPROBE_EVERY = 0.5, 0.25, 16


def screening_pays() -> bool:
    """Whether the bf16 copy is the faster read-out by default: on a CPU that multiplies bf16 natively (AVX512-BF16,
    AMX). Timing it on made-up hidden states misleads: how many tokens the screening hands to fp32 depends on how
    peaked the logits are, which only a trained model's hidden states show."""
    return native_bf16_cpu()


def screening_unavailable(lm_head: nn.Module) -> str | None:
    """None where `ScreenedArgmax` can stand in for `lm_head`'s argmax; otherwise why not."""
    if not isinstance(lm_head, nn.Linear):
        return f"the lm_head is a {type(lm_head).__name__}, not a plain Linear"
    if lm_head.weight.device.type != "cpu":
        return "the lm_head is not on the CPU"
    if lm_head.weight.dtype != torch.float32:
        return f"the lm_head is in {lm_head.weight.dtype}, not float32"
    if lm_head.bias is not None:
        return "the lm_head has a bias"
    return None


class ScreenedArgmax:
    """`argmax(lm_head(x))` for an fp32 CPU `lm_head`, through a bf16 copy and fp32 dot products where the copy
    cannot decide (module docstring). Inference only: the copy does not follow later changes to the weight."""

    def __init__(self, lm_head: nn.Linear, pack: bool | None = None, low: nn.Module | None = None,
                 full: nn.Module | None = None):
        """`low`: a bf16 copy of `lm_head` to compute through (a module with `.weight` = bf16(lm_head.weight), e.g.
        a drafter's read-out of the same lm_head); None: one of its own, packed for oneDNN where that is faster.
        `full`: the fp32 read-out small or undecidable calls take (e.g. the target's packed twin of `lm_head`);
        None: `lm_head` itself."""
        reason = screening_unavailable(lm_head)
        if reason:
            raise ValueError(f"cannot screen this lm_head: {reason}")
        weight = lm_head.weight.detach()
        self.weight = weight.numpy()  # a view: the fp32 reference rows of candidates
        self.vocab, width = weight.shape
        if low is not None and not torch.equal(low.weight.detach(), weight.to(torch.bfloat16)):
            raise ValueError("the bf16 read-out to share is not this lm_head rounded to bf16")
        if low is None:
            low = nn.Linear(width, self.vocab, bias=False).to(torch.bfloat16)
            with torch.no_grad():
                low.weight.copy_(weight)
            low.requires_grad_(False)
            if pack is None:
                pack = can_pack(low.weight) and packing_pays([low.weight], rows=(16, 64))
            if pack:
                low = packed_linear(low)
        self.low = low
        rounded = low.weight.detach().float()
        self.rounded_norms = rounded.norm(dim=1).numpy()  # ||w^_i||
        self.rounding_norms = (weight - rounded).norm(dim=1).numpy()  # ||w_i - w^_i||
        self.accumulation = 2 * width * FLOAT32_ROUNDOFF / (1 - width * FLOAT32_ROUNDOFF)  # the two fp32 sums' rounding
        self.full = lm_head if full is None else full
        self.undecided = 0.0  # moving share of rows the bf16 logits left undecided
        self.calls = 0

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] (float32) -> the token ids [...] (int64) of argmax(lm_head(x)), or with `offsets` [..., V]
        (float32) of argmax(lm_head(x) + offsets): sampled rows' race (`engine/noise.py`, `race_offsets`)."""
        shape = x.shape[:-1]
        flat = x.detach().reshape(-1, x.shape[-1])
        n = flat.shape[0]
        offset = None if offsets is None else offsets.detach().reshape(n, self.vocab).float().numpy()
        self.calls += 1
        if n < MIN_ROWS or (self.undecided > UNDECIDED_LIMIT and self.calls % REPROBE_EVERY):
            return self._full_argmax(flat, offset).reshape(shape)
        rounded = flat.to(torch.bfloat16)
        approx = self.low(rounded).float().numpy()
        scores = approx if offset is None else approx + offset
        best = scores.argmax(axis=1)
        top = scores[np.arange(n), best]
        if not np.isfinite(top).all():  # inf / NaN in the hidden states: no bound holds, the full read-out decides
            return self._full_argmax(flat, offset).reshape(shape)
        norms = torch.linalg.vector_norm(flat, dim=-1).numpy()
        residual = torch.linalg.vector_norm(flat - rounded.float(), dim=-1).numpy()
        # 1. the window every row's tokens are judged by (the largest weight norms): one pass over the logits. With
        # offsets a candidate's logit need not be near the top's, so the row's largest logit sizes the bf16 term
        magnitude = np.abs(top) if offset is None else np.maximum(approx.max(axis=1), -approx.min(axis=1))
        window = 2 * self.bound(self.rounded_norms.max(), self.rounding_norms.max(), norms, residual, magnitude)
        window = window / (1 - 2 * UNIT_ROUNDOFF)  # the bf16 rounding of a candidate below the top, too
        if offset is not None:  # fl(z^ + offset): the top's and a candidate's fp32 rounding
            window += 2 * FLOAT32_ROUNDOFF * (np.abs(top) + window)
        candidates = np.flatnonzero(scores >= (top - window)[:, None])  # row-major: rows, then ids ascending
        rows, ids = np.divmod(candidates, self.vocab)
        # 2. the candidates by their own weight norms: those whose highest possible score is below some candidate's
        # lowest possible one drop out (the approximate maximum never does)
        z = approx[rows, ids]
        bound = self.bound(self.rounded_norms[ids], self.rounding_norms[ids], norms[rows], residual[rows], np.abs(z))
        if offset is not None:
            z = scores[rows, ids]
            bound += FLOAT32_ROUNDOFF * (np.abs(z) + bound)
        starts = np.flatnonzero(np.diff(rows, prepend=-1))  # every row has a candidate, its maximum
        floor = np.maximum.reduceat(z - bound, starts)  # per row, in row order
        alive = z + bound >= floor[rows]
        rows, ids = rows[alive], ids[alive]
        # 3. rows left with several: their fp32 logits (plus offsets) decide
        counts = np.bincount(rows, minlength=n)
        self.undecided += UNDECIDED_SMOOTHING * (np.count_nonzero(counts > 1) / n - self.undecided)
        several = counts[rows] > 1
        if several.any():
            rows, ids = rows[several], ids[several]
            if len(ids) > EXACT_CANDIDATES:  # flat distributions: the rows' full fp32 read-out is cheaper
                undecided = np.unique(rows)
                best[undecided] = self._full_argmax(flat[torch.from_numpy(undecided)],
                                                    None if offset is None else offset[undecided]).numpy()
            else:
                exact = np.einsum("ij,ij->i", flat.numpy()[rows], self.weight[ids])
                if offset is not None:
                    exact += offset[rows, ids]
                # per row: the largest fp32 score, the lowest id among equals
                order = np.lexsort((ids, -exact, rows))
                first = np.ones(len(order), dtype=bool)
                first[1:] = rows[order][1:] != rows[order][:-1]
                winners = order[first]
                best[rows[winners]] = ids[winners]
        return torch.from_numpy(best.astype(np.int64)).reshape(shape)

    def bound(self, rounded_norm, rounding_norm, norm, residual, magnitude):
        """How far a bf16 logit z^ of magnitude |z^| can be from the fp32 one, with x^ = bf16(x), w^ = bf16(w):
        w . x - w^ . x^ = w^ . (x - x^) + (w - w^) . x, so before the GEMM's own rounding it is off by at most
        ||w^|| ||x - x^|| + ||w - w^|| ||x||; the two fp32 sums add gamma ||w^|| ||x||, the bf16 result u |z^|
        (over 1 - u); all of it widened by SAFETY."""
        u = UNIT_ROUNDOFF
        e0 = rounded_norm * residual + rounding_norm * norm + self.accumulation * rounded_norm * norm * (1 + u)
        return SAFETY * (e0 + u * magnitude / (1 - u))

    def _full_argmax(self, flat: torch.Tensor, offset: np.ndarray | None = None) -> torch.Tensor:
        from flashdraft.engine.argmax import argmax  # (the engine package imports this module)

        logits = self.full(flat)
        return argmax(logits if offset is None else logits + torch.from_numpy(offset))
