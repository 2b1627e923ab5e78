"""Anchor sampling and block construction for DFlash training (docs/design.md, 'Training').

Design:
- Per sequence, up to `num_anchors` anchor positions are drawn uniformly WITHOUT replacement among the response
  positions (loss_mask == 1) that have room for a full block: `anchor + block_size - 1 < length`, so every label
  of the block exists. Fewer candidates than `num_anchors` means all of them are used. With `start_anchors` = n,
  the first n candidates of every response span (an answer's first tokens, where a server's short answers spend a
  large share of their drafts and a drafter accepts least) are always taken, the rest drawn uniformly from the
  others: a 128-token answer with 32 anchors otherwise gives its first block 1 / 113 of the answer's blocks.
- The draw is a pure function of (seed, epoch, sample index): `anchor_generator` derives a fresh torch.Generator,
  so anchors are resampled every epoch, do not depend on how data is split across ranks or micro-batches, and a
  resumed run draws exactly what the uninterrupted one would have drawn.
- `build_blocks` turns a padded batch plus per-row anchors into the drafter's training inputs, vectorised (no loop
  over blocks): block j of a row is `[token[anchor_j], MASK x (B-1)]` at positions `anchor_j .. anchor_j + B-1`;
  the label at block position k >= 1 is `token[anchor_j + k]`; position 0 never has a loss. Label validity is
  `loss_mask[anchor_j + k]` (labels outside the response get weight 0). Rows with fewer anchors are padded with
  invalid blocks (anchor 0, no labels), which only attend to themselves (see `masks.py`).

What this module does not know about: the attention mask (`masks.py`), loss weights per position (`loss.py`),
the target model, and where the sequences came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15


def anchor_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    """A generator seeded by (seed, epoch, sample index) only: same anchors whatever the batching or world size."""
    h = (int(seed) * 1_000_003 + int(epoch)) * _MIX + int(sample_index) * 0x85EBCA6B
    return torch.Generator().manual_seed(h % (2**63 - 1))


def candidate_anchors(loss_mask: torch.Tensor, block_size: int, length: int | None = None) -> torch.Tensor:
    """Positions p with loss_mask[p] set and p + block_size - 1 < length (1-D loss_mask of one sequence)."""
    loss_mask = loss_mask.bool()
    length = loss_mask.shape[0] if length is None else int(length)
    ok = loss_mask.clone()
    ok[max(0, length - block_size + 1):] = False
    return ok.nonzero().flatten()


def span_offsets(loss_mask: torch.Tensor) -> torch.Tensor:
    """Each position's offset from the first position of its response span (runs of loss_mask == 1; positions
    before the first span count from 0)."""
    mask = loss_mask.bool()
    index = torch.arange(mask.shape[0])
    starts = mask & ~torch.cat([mask.new_zeros(1), mask[:-1]])
    return index - torch.cummax(torch.where(starts, index, 0), 0).values


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator | None = None,
    length: int | None = None, start_anchors: int = 0,
) -> torch.Tensor:
    """Up to `num_anchors` candidate anchors, returned sorted (LongTensor): the first `start_anchors` candidates of
    every response span, then the rest drawn uniformly without replacement."""
    cand = candidate_anchors(loss_mask, block_size, length)
    if cand.numel() <= num_anchors:
        return cand
    forced = span_offsets(loss_mask)[cand] < start_anchors
    fixed, free = cand[forced][:num_anchors], cand[~forced]
    pick = torch.randperm(free.numel(), generator=generator)[:num_anchors - fixed.numel()]
    return torch.cat([fixed, free[pick]]).sort().values


@dataclass
class BlockBatch:
    """Drafter training inputs for a padded batch; Q = num_blocks * block_size query slots per row."""

    block_ids: torch.Tensor  # [b, Q] anchor token then MASK tokens
    position_ids: torch.Tensor  # [b, Q] absolute positions anchor + k
    labels: torch.Tensor  # [b, Q] token at anchor + k (0 where invalid)
    label_valid: torch.Tensor  # [b, Q] bool: k >= 1, real block, label inside the sequence and the loss mask
    block_offset: torch.Tensor  # [b, Q] k = 0 .. B-1
    anchors: torch.Tensor  # [b, N] (0 for padding blocks)
    anchor_valid: torch.Tensor  # [b, N] bool
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]


def pad_anchors(anchor_lists: list[torch.Tensor], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-row anchor lists into [b, N] with a validity mask (N = the longest list, at least 1)."""
    n = max([1] + [int(a.numel()) for a in anchor_lists])
    anchors = torch.zeros(len(anchor_lists), n, dtype=torch.long, device=device)
    valid = torch.zeros(len(anchor_lists), n, dtype=torch.bool, device=device)
    for i, a in enumerate(anchor_lists):
        anchors[i, : a.numel()] = a.to(device)
        valid[i, : a.numel()] = True
    return anchors, valid


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> BlockBatch:
    """Vectorised block construction. input_ids/loss_mask [b, T] (right-padded; padding has loss_mask 0)."""
    b, t = input_ids.shape
    n = anchors.shape[1]
    dev = input_ids.device
    offsets = torch.arange(block_size, device=dev)
    pos = anchors[:, :, None] + offsets[None, None, :]  # [b, N, B]
    inside = pos < t
    safe = pos.clamp(max=t - 1).reshape(b, n * block_size)
    labels = input_ids.gather(1, safe).reshape(b, n, block_size)
    in_loss = loss_mask.bool().gather(1, safe).reshape(b, n, block_size)
    label_valid = (offsets >= 1)[None, None, :] & anchor_valid[:, :, None] & inside & in_loss
    block_ids = torch.full((b, n, block_size), int(mask_token_id), dtype=input_ids.dtype, device=dev)
    block_ids[:, :, 0] = input_ids.gather(1, anchors.clamp(max=t - 1))
    labels = torch.where(label_valid, labels, torch.zeros_like(labels))
    q = n * block_size
    return BlockBatch(
        block_ids=block_ids.reshape(b, q),
        position_ids=pos.reshape(b, q),
        labels=labels.reshape(b, q),
        label_valid=label_valid.reshape(b, q),
        block_offset=offsets.repeat(n)[None].expand(b, q),
        anchors=anchors,
        anchor_valid=anchor_valid,
        block_size=block_size,
    )
