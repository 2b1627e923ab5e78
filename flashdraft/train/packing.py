"""Sequence packing: many short training examples in one row, with attention kept inside each example.

Design:
- `pack_rows` groups examples (by index, in load order) into rows of at most `max_length` tokens, greedily: an
  example joins the current row while it fits, else opens the next one. The grouping is fixed for the run (the
  trainer shuffles rows, not examples, each epoch), so a resumed run sees the same rows.
- `pack_batch` lays a micro-batch of rows out as right-padded tensors: the examples of a row back to back, each
  with its own positions 0..n-1 (RoPE sees what it sees unpacked) and its own segment id (0, 1, ... per row; -1 on
  padding).
- Masks stay exact: the target's feature pass gets `segment_causal_mask` (a query sees the keys of its own example
  at or before it; a padding slot sees itself only), and the drafter's training mask takes the same segment ids
  (`masks.py`: a block sees context of its own example only). Anchors are drawn per example, seeded by the
  example's index, and shifted by its offset in the row, so a packed step trains on exactly the blocks, labels and
  loss weights the same examples give unpacked (tests/test_train_packing.py checks losses and gradients).

What this module does not know about: anchors, the models and the order of rows in an epoch (`trainer.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pack_rows(lengths: list[int], max_length: int) -> list[list[int]]:
    """Indices of examples grouped into rows of at most `max_length` tokens, greedily in order."""
    rows: list[list[int]] = []
    used = max_length
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"example {i} has {n} tokens, more than a packed row's {max_length}")
        if used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


@dataclass
class PackedBatch:
    """A micro-batch of rows, each the concatenation of its examples; [b, T] tensors, right-padded."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor  # bool
    valid: torch.Tensor  # bool: a real token (not padding)
    positions: torch.Tensor  # position inside its own example
    segments: torch.Tensor  # example number inside the row (-1: padding)
    offsets: list[list[int]]  # per row: where each of its examples starts


def pack_batch(rows: list[list[torch.Tensor]], loss_masks: list[list[torch.Tensor]] | None = None) -> PackedBatch:
    """Lay out rows of 1-D token tensors (and their loss masks) back to back, right-padded to the longest row."""
    width = max(sum(int(s.numel()) for s in row) for row in rows)
    b = len(rows)
    ids = torch.zeros(b, width, dtype=torch.long)
    loss = torch.zeros(b, width, dtype=torch.bool)
    positions = torch.zeros(b, width, dtype=torch.long)
    segments = torch.full((b, width), -1, dtype=torch.long)
    offsets: list[list[int]] = []
    for r, row in enumerate(rows):
        start, starts = 0, []
        for k, seq in enumerate(row):
            n = int(seq.numel())
            ids[r, start:start + n] = seq
            if loss_masks is not None:
                loss[r, start:start + n] = loss_masks[r][k]
            positions[r, start:start + n] = torch.arange(n)
            segments[r, start:start + n] = k
            starts.append(start)
            start += n
        offsets.append(starts)
    return PackedBatch(ids, loss, segments >= 0, positions, segments, offsets)


def segment_causal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [b, 1, T, T] for a transformers target: 0 where query i may see key j (same example, j <= i;
    a padding slot sees itself), the dtype's minimum elsewhere. Additive, so every attention implementation that
    takes a 4-D mask (eager, sdpa) reads it the same way."""
    t = segments.shape[1]
    idx = torch.arange(t, device=segments.device)
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] >= 0)
    allowed = (same & (idx[None, None, :] <= idx[None, :, None])) | torch.eye(t, dtype=torch.bool,
                                                                              device=segments.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
