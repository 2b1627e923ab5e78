"""The target's KV cache as the engine sees it: prefill a set of prompts, verify a block, keep the accepted prefix,
drop rows, merge rows. Two implementations with one interface:

- `DynamicTargetKV`, the generic path for ANY transformers decoder: transformers' DynamicCache, prompts
  left-padded, explicit per-row positions and a per-row slot mask. Rows that accepted fewer tokens than the
  longest keep masked holes; the cache is cropped to the longest kept prefix (no copies).
- `StaticTargetKV`, the fast path (Llama / Mistral / Qwen2 / Qwen3 through `FastTarget`): a static per-row cache
  where slot = position, so keeping the accepted prefix is a no-op and rows never hold holes.

What this module does not know about: drafting, acceptance, stop conditions.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from flashdraft.model.fast_target import FastTarget
from flashdraft.model.slots import compaction_order, gather_slots
from flashdraft.model.target import TargetModel


def zero_pad(x: torch.Tensor, width: int, dim: int, at_end: bool = False) -> torch.Tensor:
    """Zero/False-pad `x` along `dim` to `width`, at the start (default) or at the end."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    zeros = x.new_zeros(shape)
    return torch.cat([x, zeros] if at_end else [zeros, x], dim=dim)


class DynamicTargetKV:
    def __init__(self, target: TargetModel, cache: DynamicCache, slot_mask: torch.Tensor):
        self.target = target
        self.cache = cache
        self.slot_mask = slot_mask  # [b, S] which cache slots hold real tokens of the row

    @classmethod
    def prefill(cls, target: TargetModel, prompts: list[list[int]], capture: bool, pad_id: int = 0):
        """(state, last-position logits [b, V], features [b, W, F] or None, feature positions, feature validity)."""
        dev = target.device
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=dev)
            mask[i, width - len(p):] = True
        positions = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
        cache = DynamicCache()
        logits, features = target.forward(ids, positions, mask.long(), cache, logits_to_keep=1, capture=capture)
        return cls(target, cache, mask), logits[:, -1], features, positions, mask

    def verify(self, block: torch.Tensor, positions: torch.Tensor, capture: bool, end: int):
        attention = torch.cat([self.slot_mask, torch.ones_like(block, dtype=torch.bool)], dim=1).long()
        return self.target.forward(block, positions, attention, self.cache, capture=capture)

    def keep(self, kept: torch.Tensor, width: int, kept_valid: torch.Tensor) -> None:
        """After a verify of a block: keep the first `kept[r]` block slots of each row (width = kept.max())."""
        extra = self.cache.get_seq_length() - (self.slot_mask.shape[1] + width)
        if extra > 0:
            self.cache.crop(-extra)
        self.slot_mask = torch.cat([self.slot_mask, kept_valid], dim=1)
        self.compact()

    @property
    def num_rows(self) -> int:
        return self.slot_mask.shape[0]

    def shrink(self, capacity: int) -> None:
        pass  # a dynamic cache holds only what was written (and compacts its holes)

    def select_rows(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.slot_mask = self.slot_mask.index_select(0, idx)
        self.compact()

    def compact(self) -> None:
        """Squeeze out holes (rejected slots, finished rows' padding) once they are most of the cache."""
        order = compaction_order(self.slot_mask)
        if order is None:
            return
        for layer in self.cache.layers:
            layer.keys = gather_slots(layer.keys, order, 2)
            layer.values = gather_slots(layer.values, order, 2)
        self.slot_mask = self.slot_mask.gather(1, order)

    def merge(self, other: "DynamicTargetKV") -> None:
        """Append other's rows; caches are aligned on the slot axis by left-padding with masked slots."""
        width = max(self.slot_mask.shape[1], other.slot_mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([zero_pad(mine.keys, width, 2), zero_pad(theirs.keys, width, 2)], dim=0)
            mine.values = torch.cat([zero_pad(mine.values, width, 2), zero_pad(theirs.values, width, 2)], dim=0)
        self.slot_mask = torch.cat([zero_pad(self.slot_mask, width, 1), zero_pad(other.slot_mask, width, 1)])


class StaticTargetKV:
    def __init__(self, fast: FastTarget, kv, compiled_forward=None):
        self.fast = fast
        self.kv = kv
        self.compiled_forward = compiled_forward  # `fast.forward` compiled (attends over the whole capacity)

    @classmethod
    def prefill(cls, fast: FastTarget, prompts: list[list[int]], capture: bool, capacity: int,
                compiled_forward=None, pad_id: int = 0):
        dev = fast.target.device
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=dev)  # right-padded: slot = position
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        positions = torch.arange(width, device=dev)[None].expand(len(prompts), -1)
        valid = positions < lengths[:, None]
        kv = fast.new_cache(len(prompts), max(capacity, width))
        logits, features = fast.forward(ids, positions, kv, logit_index=lengths - 1, capture=capture, key_len=width)
        return cls(fast, kv, compiled_forward), logits[:, 0], features, positions, valid

    def verify(self, block: torch.Tensor, positions: torch.Tensor, capture: bool, end: int):
        """Logits and features of the block; `end` = 1 + the largest position in it."""
        self.kv.ensure_capacity(end)
        if self.compiled_forward is not None:
            return self.compiled_forward(block, positions, self.kv, capture=capture)
        return self.fast.forward(block, positions, self.kv, capture=capture, key_len=end)

    def keep(self, kept: torch.Tensor, width: int, kept_valid: torch.Tensor) -> None:
        pass  # the next block overwrites the rejected slots

    @property
    def num_rows(self) -> int:
        return self.kv.batch

    def select_rows(self, idx: torch.Tensor) -> None:
        self.kv.select_rows(idx)

    def join_rows(self, keep: int, add: int) -> None:
        self.kv.join_rows(keep, add)

    def shrink(self, capacity: int) -> None:
        self.kv.shrink(capacity)

    def merge(self, other: "StaticTargetKV", keep: int | None = None, pad: int = 0) -> None:
        """Rows [0, keep) of ours, other's rows, then `pad` padding rows (see `StaticKV.merge`)."""
        self.kv.merge(other.kv, keep, pad)
