"""The DFlash2 candidate selector's training loss (docs/design.md, 'DFlash2').

Teacher forcing: at block slot k the selector scores the marginal's top-k candidates given the TRUE token at k-1
(the anchor at k = 1), and the loss is the cross-entropy of softmax(scores) against the true token at k, where that
token is among the candidates (elsewhere the selector has no choice to learn; the marginal's own loss has to bring
the token into the top-k), optionally mixed (`distill_weight`) with KL(target || selector) over the candidates: the
target's own distribution for that token given the true prefix, which is what the selector's q should be at T = 1
and, unlike one sampled label, says so for every candidate at once. The marginal logits enter detached: this loss
trains the pair term (codebooks, hidden projection) and, through the projection, the draft layers. Each slot
carries the marginal loss's position weight, and the sum is normalised like the marginal loss (`loss.py`), so
accumulation and ranks see one big batch.

Why teacher forcing is the right conditioning here: a drafted token only counts while every token before it in the
block was accepted, i.e. equalled the target's; the training labels are the target's own tokens, so conditioning on
them trains the selector in exactly the situations whose outcome matters.

What this module does not know about: anchors, masks and the trainer's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flashdraft.train.loss import LossOutput, at_temperature, kl_divergence


@dataclass
class SelectorLoss:
    loss: torch.Tensor  # scalar, differentiable: sum(w * ce) / normaliser over slots whose label is a candidate
    hits: torch.Tensor  # detached: slots where the selector's argmax is the label
    count: torch.Tensor  # detached: weighted slots (label among the candidates or not)


def previous_tokens(block_ids: torch.Tensor, labels: torch.Tensor, block_offset: torch.Tensor) -> torch.Tensor:
    """[b, Q]: the true token before each block slot: the anchor (slot 0's token) for slot 1, the label of slot k-1
    for slot k >= 2 (blocks lie back to back along Q)."""
    return torch.where(block_offset == 1, block_ids.roll(1, dims=1), labels.roll(1, dims=1))


def _chunk(selector, hidden, logits_fn, previous, labels, weights, teacher, distill_weight, temperature,
           logits=None, log_teacher=None):
    """`logits` (the marginal's) and `log_teacher` (log-softmax of the teacher at `temperature`), where the marginal
    loss already computed them, else computed here from `logits_fn` and `teacher`."""
    if logits is None:
        with torch.no_grad():
            logits = logits_fn(hidden)
    scores, target, present, candidates = selector.teacher_forced(hidden, logits, previous, labels)
    distilling = (teacher is not None or log_teacher is not None) and distill_weight > 0
    if not distilling or distill_weight < 1:  # the hard-label term; at distillation weight 1 it is multiplied by 0
        per_slot = F.cross_entropy(scores.float(), target, reduction="none") * present
    if distilling:
        if log_teacher is None:
            log_teacher = F.log_softmax(at_temperature(teacher.float(), temperature), dim=-1)
        if candidates is not None:  # renormalised over them (log-softmax is shift-invariant: the same as of the
            log_teacher = F.log_softmax(log_teacher.gather(-1, candidates), dim=-1)  # gathered teacher logits)
        kl = kl_divergence(log_teacher, F.log_softmax(at_temperature(scores.float(), temperature), dim=-1),
                           temperature)
        per_slot = kl if distill_weight >= 1 else (1.0 - distill_weight) * per_slot + distill_weight * kl
    hits = (scores.argmax(-1) == target) & present
    return (per_slot * weights).sum(), hits.float().sum()


def selector_loss(drafter, hidden: torch.Tensor, logits_fn, block_ids: torch.Tensor, labels: torch.Tensor,
                  weights: torch.Tensor, block_offset: torch.Tensor, normaliser: float | torch.Tensor,
                  chunk_size: int = 4096, teacher_logits: torch.Tensor | None = None, distill_weight: float = 0.0,
                  temperature: float = 1.0, marginal: LossOutput | None = None) -> SelectorLoss:
    """hidden [b, Q, H] (the drafter's, before the read-out); block_ids / labels / weights / block_offset [b, Q] as
    `build_blocks` and `slot_weights` give them; `logits_fn(hidden_rows) -> [M, V]` the marginal read-out;
    `teacher_logits` [b, Q, V] the target's logits for each slot's token (given the true prefix) with
    `distill_weight` > 0: the soft-label term, KL(target || selector) over the candidates at `temperature`.
    `marginal`: the marginal loss's output for the same slots and teacher (`loss.dflash_loss`), whose logits and
    teacher log-probabilities are used where it kept them."""
    selected = weights > 0
    previous = previous_tokens(block_ids, labels, block_offset)[selected]
    h, y, w = hidden[selected], labels[selected], weights[selected].float()
    t = teacher_logits[selected] if teacher_logits is not None and distill_weight > 0 else None
    shared_logits = marginal.logits if marginal is not None else None
    shared_teacher = marginal.teacher_log_probs if marginal is not None and t is not None else None
    total = hidden.new_zeros((), dtype=torch.float32)
    hits = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, h.shape[0], chunk_size):
        part = (drafter.candidate_selector, h[start:start + chunk_size], logits_fn, previous[start:start + chunk_size],
                y[start:start + chunk_size], w[start:start + chunk_size],
                None if t is None else t[start:start + chunk_size], distill_weight, temperature)
        if torch.is_grad_enabled() and h.shape[0] > chunk_size:
            loss, hit = checkpoint(_chunk, *part, use_reentrant=False)
        else:
            end = start + chunk_size
            loss, hit = _chunk(*part, None if shared_logits is None else shared_logits[start:end],
                               None if shared_teacher is None else shared_teacher[start:end])
        total, hits = total + loss, hits + hit.detach()
    if h.shape[0] == 0:
        total = hidden.sum() * 0.0
    return SelectorLoss(total / normaliser, hits, torch.tensor(float(h.shape[0]), device=hidden.device))
