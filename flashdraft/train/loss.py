"""The DFlash training loss: position-decayed cross-entropy over block labels, optional soft-label distillation.

Design (docs/design.md, 'Training'):
- Block position k >= 1 gets weight `w_k = exp(-(k - 1) / gamma)` (early positions matter most: a draft is only
  accepted up to its first miss). Default gamma: 7 for B=16, 5 for B=10, 4 for B=8 (the paper's values); other
  block sizes interpolate linearly through those points (`gamma = (B + 5) / 3`, clamped to >= 1).
- The loss is `sum(w * ce) / normaliser`. The normaliser defaults to the sum of the weights of the valid labels
  in the batch; the trainer passes the weight sum of the whole optimizer step across micro-batches and ranks, so
  gradient accumulation and DDP give exactly the gradient of one big batch.
- Logits are computed only for labelled slots, in chunks under activation checkpointing, so the [slots x vocab]
  logits of a large-vocabulary target are never all alive at once.
- Distillation (`distill_weight` alpha > 0): the per-slot loss becomes `(1 - alpha) * ce + alpha * KL(p_t || p_d)`,
  where p_t is the target's distribution for the same token: the target logits at position `anchor + k - 1`
  (they predict token `anchor + k`). Callers pass those logits already gathered per slot.

What this module does not know about: anchors and masks, where the target logits come from, and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B = 16 / 10 / 8, else (B + 5) / 3 (the line through those points), at least 1."""
    if block_size in PAPER_GAMMA:
        return PAPER_GAMMA[block_size]
    return max(1.0, (block_size + 5) / 3.0)


def position_weights(block_size: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """[B] weights: w_0 = 0 (the anchor has no loss), w_k = exp(-(k - 1) / gamma) for k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def slot_weights(block_offset: torch.Tensor, label_valid: torch.Tensor, block_size: int, gamma: float | None) -> torch.Tensor:
    """Per-slot loss weights [b, Q]: the position weight of the slot's offset k, zero for invalid labels."""
    w = position_weights(block_size, gamma, device=block_offset.device)
    return w[block_offset] * label_valid.float()


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable: sum(w * per_slot_loss) / normaliser
    weighted_sum: torch.Tensor  # detached sum(w * per_slot_loss)
    weight_sum: torch.Tensor  # detached sum(w)
    correct: torch.Tensor  # [B] argmax hits per block position (detached, float)
    count: torch.Tensor  # [B] labelled slots per block position
    # with `keep`: the labelled slots' logits and the teacher's log-probabilities at `temperature` [M, V] (detached)
    # where the loss ran as one chunk, for the DFlash2 selector's loss (`selector.py`) to read instead of computing
    # them again (None where chunked under checkpointing, or without a teacher)
    logits: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None


def _chunk_loss(hidden, labels, weights, teacher, logits_fn, distill_weight, temperature):
    """(sum of weighted per-slot losses, argmax hits, the logits, the teacher's log-probabilities or None)."""
    logits = logits_fn(hidden).float()
    if teacher is None or distill_weight <= 0:
        return (F.cross_entropy(logits, labels, reduction="none") * weights).sum(), _hits(logits, labels), logits, None
    # one log-softmax of the draft serves both terms at temperature 1 (cross_entropy computes the same one)
    log_p_draft = F.log_softmax(at_temperature(logits, temperature), dim=-1)
    log_p_teacher = F.log_softmax(at_temperature(teacher.float(), temperature), dim=-1)
    per_slot = kl_divergence(log_p_teacher, log_p_draft, temperature)
    if distill_weight < 1:  # the hard-label term; at weight 1 it is multiplied by 0, so not computed
        ce = (F.nll_loss(log_p_draft, labels, reduction="none") if temperature == 1
              else F.cross_entropy(logits, labels, reduction="none"))
        per_slot = (1.0 - distill_weight) * ce + distill_weight * per_slot
    return (per_slot * weights).sum(), _hits(logits, labels), logits, log_p_teacher


def at_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature (the logits themselves at 1: no division, no copy)."""
    return logits if temperature == 1 else logits / temperature


def kl_divergence(log_teacher: torch.Tensor, log_student: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per row KL(teacher || student) from log-probabilities at `temperature`, scaled by temperature^2 (Hinton's
    correction, so the gradient's size does not depend on it)."""
    return (log_teacher.exp() * (log_teacher - log_student)).sum(-1) * (temperature**2)


def _hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == labels).float()


def dflash_loss(
    hidden: torch.Tensor,
    logits_fn,
    labels: torch.Tensor,
    weights: torch.Tensor,
    block_offset: torch.Tensor,
    block_size: int,
    normaliser: float | torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    distill_weight: float = 0.0,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    keep: bool = False,
) -> LossOutput:
    """hidden [b, Q, H]; labels/weights/block_offset [b, Q]; teacher_logits [b, Q, V] or None; `keep`: return the
    logits and teacher log-probabilities (`LossOutput.logits`).

    `logits_fn(hidden_rows [M, H]) -> [M, V]` (the drafter's read-out through the target lm_head).
    """
    sel = weights > 0
    h = hidden[sel]
    y = labels[sel]
    w = weights[sel].float()
    k = block_offset[sel]
    t = teacher_logits[sel] if teacher_logits is not None else None
    weight_sum = w.sum().detach()
    if normaliser is None:
        normaliser = weight_sum.clamp_min(1e-8)
    total = hidden.new_zeros((), dtype=torch.float32)
    hits_all = []
    m = h.shape[0]
    chunk = max(1, int(chunk_size))
    kept = (None, None)
    for start in range(0, m, chunk):
        args = (h[start:start + chunk], y[start:start + chunk], w[start:start + chunk],
                None if t is None else t[start:start + chunk])
        if torch.is_grad_enabled() and m > chunk:
            part, hits, *_ = checkpoint(_chunk_loss, *args, logits_fn, distill_weight, temperature,
                                        use_reentrant=False)
        else:
            part, hits, logits, log_teacher = _chunk_loss(*args, logits_fn, distill_weight, temperature)
            if keep and m <= chunk:
                kept = (logits.detach(), None if log_teacher is None else log_teacher.detach())
        total = total + part
        hits_all.append(hits.detach())
    if m == 0:
        total = hidden.sum() * 0.0  # keep the graph connected (DDP needs every rank to backprop)
    hits = torch.cat(hits_all) if hits_all else hidden.new_zeros(0)
    correct = torch.zeros(block_size, device=hidden.device).index_add_(0, k, hits.float())
    count = torch.zeros(block_size, device=hidden.device).index_add_(0, k, torch.ones_like(hits, dtype=torch.float32))
    return LossOutput(total / normaliser, total.detach(), weight_sum, correct, count, *kept)


def gather_teacher_logits(target_logits: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Target logits [b, T, V] -> [b, Q, V] at position `pos - 1` for each slot (they predict the token at pos)."""
    idx = (position_ids - 1).clamp(min=0, max=target_logits.shape[1] - 1)
    return target_logits.gather(1, idx[..., None].expand(-1, -1, target_logits.shape[-1]))


