"""Slot-axis helpers shared by the KV caches that keep per-row validity masks (target and drafter)."""

from __future__ import annotations

import torch


def compaction_order(valid: torch.Tensor) -> torch.Tensor | None:
    """Per-row slot order that moves each row's valid slots to the front (stable), cut to the longest row;
    None when at most half the slots would be saved (not worth a copy)."""
    if valid.numel() == 0:
        return None
    width = int(valid.sum(dim=1).max())
    if width > valid.shape[1] // 2:
        return None
    return torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :width]


def gather_slots(x: torch.Tensor, order: torch.Tensor, dim: int) -> torch.Tensor:
    """x[b, ..., order[b, j], ...] along the slot axis `dim`; order is [b, width]."""
    view = [order.shape[0]] + [1] * (x.dim() - 1)
    view[dim] = order.shape[1]
    size = list(x.shape)
    size[dim] = order.shape[1]
    return x.gather(dim, order.view(view).expand(size))
