"""The target's KV cache as the engine sees it. Two implementations with one interface, all in live rows:

    cache, logits, features = Cache.prefill(...)         the prompts; last-position logits, each row's features
    logits, features = cache.forward_block(block, positions, capture, end)
                                                          the target over one block per row (logits [b, w, V])
    [(logits, features)] = cache.forward_ragged(groups, capture, end)
                                                          fast path, eager: rows of different widths (per group)
    cache.keep(kept_valid)                                after verification: which block slots stay
    cache.move_slots(rows, source, dest)                  fast path: a token tree's accepted path to its positions
    cache.add_rows(lengths)                               fast path, eager: rows whose prompts the next
                                                          `forward_ragged` prefills (`prompts=`)
    cache.reserve(lengths)                                row r may write positions < lengths[r] (paged cache:
                                                          pages for them; the batch asks before every cycle)
    cache.select_rows(idx) / cache.merge(other) / cache.num_rows

- `DynamicTargetKV`, the generic path for ANY transformers decoder: transformers' DynamicCache, prompts
  left-padded, explicit per-row positions and a per-row slot mask. Rows that accepted fewer tokens than the
  longest keep masked holes; the cache is cropped to the longest kept prefix (no copies).
- `PagedTargetKV`, the fast path (the families `FastTarget` knows: Llama, Mistral, Qwen, Phi-3, Gemma, MoE kin): a
  paged per-row cache (`slots.PagedKV`) with one slot per position, so keeping the accepted prefix is a no-op and
  rows never hold holes; each row owns pages for its own positions only. For compiled steps it holds a bucketed
  row count (`RowBuckets`; padding rows own no pages) and pads its inputs and unpads its outputs itself.

What this module does not know about: drafting, acceptance, stop conditions.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import DynamicCache

from flashdraft.engine.batch import RowBuckets, zero_pad
from flashdraft.engine.prefix_cache import PrefixCache, PrefixHit
from flashdraft.model.fast_target import FastTarget, resolved
from flashdraft.model.slots import DEFAULT_PAGE_SIZE, PagedKV, compaction_order, gather_slots
from flashdraft.model.target import TargetModel


class DynamicTargetKV:
    def __init__(self, target: TargetModel, cache: DynamicCache, slot_mask: torch.Tensor):
        self.target = target
        self.cache = cache
        self.slot_mask = slot_mask  # [b, S] which cache slots hold real tokens of the row

    @classmethod
    def prefill(cls, target: TargetModel, prompts: list[list[int]], capture: bool, pad_id: int = 0):
        """(cache, last-position logits [b, V], each prompt's features [n_r, F] or None)."""
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
        prompt_features = None if features is None else [f[m] for f, m in zip(features, mask)]
        return cls(target, cache, mask), logits[:, -1], prompt_features

    def forward_block(self, block: torch.Tensor, positions: torch.Tensor, capture: bool, end: int,
                      greedy: bool = False, offsets=None):  # (transformers' forward: always the logits)
        attention = torch.cat([self.slot_mask, torch.ones_like(block, dtype=torch.bool)], dim=1).long()
        return self.target.forward(block, positions, attention, self.cache, capture=capture)

    def keep(self, kept_valid: torch.Tensor) -> None:
        """After verification: block slot j of row r stays iff kept_valid[r, j] (a prefix of each row's block).
        The cache is cropped to the longest kept prefix; shorter rows' rejected slots become masked holes."""
        width = int(kept_valid.sum(dim=1).max())
        extra = self.cache.get_seq_length() - (self.slot_mask.shape[1] + width)
        if extra > 0:
            self.cache.crop(-extra)
        self.slot_mask = torch.cat([self.slot_mask, kept_valid[:, :width]], dim=1)
        self.compact()

    @property
    def num_rows(self) -> int:
        return self.slot_mask.shape[0]

    def reserve(self, lengths: list[int], keep_from: list[int] | None = None) -> None:
        pass  # a dynamic cache grows by what each forward writes (and compacts its holes)

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


class PagedTargetKV:
    def __init__(self, fast: FastTarget, kv: PagedKV, live: int, buckets: RowBuckets, compiled_forward=None):
        self.fast = fast
        self.kv = kv  # holds buckets.rows(live) rows: the live ones first, then padding
        self.live = live
        self.buckets = buckets
        self.compiled_forward = compiled_forward  # `fast.forward` compiled (attends over the whole capacity)

    @classmethod
    def prefill(cls, fast: FastTarget, prompts: list[list[int]], capture: bool, lengths: list[int],
                page_size: int = DEFAULT_PAGE_SIZE, buckets: RowBuckets = RowBuckets(), compiled_forward=None,
                pad_id: int = 0, exact_from: list[int] | None = None, max_pages: int | None = None,
                cached: tuple[PrefixCache, list[PrefixHit]] | None = None):
        """Rows own pages for `lengths` positions (at least their prompts); `exact_from`: per row, where the
        tokens a resumed row had decoded start (`FastTarget.prefill`). `cached`: a prefix cache and each row's hit
        in it: those pages are copied in and each prompt computes only the rest (one ragged forward); the features
        returned are then those of the rest only."""
        if cached is not None and any(hit.slots for hit in cached[1]):
            return cls._prefill_after(fast, prompts, capture, lengths, page_size, buckets, compiled_forward,
                                      max_pages, *cached, resumed=exact_from is not None)
        dev = fast.target.device
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=dev)  # right-padded: slot = position
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        positions = torch.arange(width, device=dev)[None].expand(len(prompts), -1)
        kv = fast.new_cache(len(prompts), [max(n, len(p)) for n, p in zip(lengths, prompts)], page_size, max_pages)
        logits, features = fast.prefill(ids, positions, kv, lengths, capture, exact_from)
        live = len(prompts)
        kv.join_rows(live, buckets.rows(live) - live)  # the padding rows compiled steps see
        return cls(fast, kv, live, buckets, compiled_forward), logits[:, 0], features

    @classmethod
    def _prefill_after(cls, fast: FastTarget, prompts: list[list[int]], capture: bool, lengths: list[int],
                       page_size: int, buckets: RowBuckets, compiled_forward, max_pages: int | None,
                       cache: PrefixCache, hits: list[PrefixHit], resumed: bool = False):
        """`prefill` of prompts whose first pages the prefix cache holds: each row its own group of the positions
        after its hit, attending to the pages copied in (`resumed` rows: their committed tokens, the next pending)."""
        dev = fast.target.device
        kv = fast.new_cache(len(prompts), [max(n, len(p)) for n, p in zip(lengths, prompts)], page_size, max_pages)
        cache.load(kv, range(len(prompts)), hits)
        groups = [(torch.tensor([i], device=dev), torch.tensor([p[hit.tokens:]], device=dev),
                   torch.arange(hit.tokens, len(p), device=dev)[None])
                  for i, (p, hit) in enumerate(zip(prompts, hits))]
        outputs = fast.forward_ragged([], kv, capture, prompts=groups,
                                      prompt_sequences=[len(p) + 1 for p in prompts] if resumed else None)
        live = len(prompts)
        kv.join_rows(live, buckets.rows(live) - live)
        logits = torch.cat([row_logits[:, -1] for row_logits, _ in outputs])
        return cls(fast, kv, live, buckets, compiled_forward), logits, [f[0] for _, f in outputs] if capture else None

    def forward_block(self, block: torch.Tensor, positions: torch.Tensor, capture: bool, end: int,
                      greedy: bool = False, offsets: torch.Tensor | None = None):
        """Logits (with `greedy`, where the target screens its read-out: the token ids of their argmax, plus
        `offsets` [n, w, V] where given) and features of the live rows' blocks; `end` = 1 + the largest position
        in them."""
        n, rows = block.shape[0], self.kv.batch
        if rows > n:  # padding rows decode zeros at positions 0..w-1 into the trash page: never read
            block = self.buckets.pad(block, rows)
            positions = torch.cat([positions, torch.arange(positions.shape[1], device=positions.device)
                                   .expand(rows - n, -1)])
        if self.compiled_forward is not None:
            logits, features = self.compiled_forward(block, positions, self.kv, capture=capture)
        else:
            if offsets is not None and rows > n:
                offsets = functools.partial(_padded_offsets, offsets, rows - n)
            logits, features = self.fast.forward(block, positions, self.kv, capture=capture, key_len=end,
                                                 greedy=greedy, offsets=offsets)
        if rows > n:
            logits, features = logits[:n], (features[:n] if features is not None else None)
        return logits, features

    def forward_ragged(self, groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], capture: bool, end: int,
                       prompts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (), greedy: bool = False,
                       offsets: list[torch.Tensor | None] | None = None):
        """Rows of different widths in one eager forward (`FastTarget.forward_ragged`): groups of (live rows,
        blocks [g, w], positions [g, w]), and `prompts` of rows added by `add_rows` (their last logits only);
        (logits, features) per group, then per prompt group."""
        return self.fast.forward_ragged(groups, self.kv, capture, prompts, greedy, offsets)

    def add_rows(self, lengths: list[int]) -> None:
        """Fresh rows below the live ones, with pages for `lengths` positions each: rows whose prompts the next
        `forward_ragged` prefills. Eager only (compiled steps pad rows to buckets)."""
        self.kv.join_rows(self.live, len(lengths))
        self.kv.reserve([0] * self.live + lengths)
        self.live += len(lengths)

    def keep(self, kept_valid: torch.Tensor) -> None:
        pass  # the next block overwrites the rejected slots

    def move_slots(self, rows: torch.Tensor, source: torch.Tensor, dest: torch.Tensor) -> None:
        """A token tree's accepted path (scratch slots `source`) into consecutive positions `dest` (`tree.py`)."""
        self.kv.move_slots(rows, source, dest)

    @property
    def num_rows(self) -> int:
        return self.live

    def select_rows(self, idx: torch.Tensor) -> None:
        self.live = len(idx)
        self.kv.select_rows(self.buckets.padded_index(idx))

    def reserve(self, lengths: list[int], keep_from: list[int] | None = None) -> None:
        """`PagedKV.reserve`: a windowed layer's pages before a row's `keep_from` less its window go back."""
        self.kv.reserve(lengths, keep_from)

    def merge(self, other: "PagedTargetKV") -> None:
        """Our live rows, other's live rows, then the padding the new row count needs."""
        if other.kv.batch > other.live:
            other.kv.select_rows(torch.arange(other.live, device=other.kv.keys[0].device))
        keep, self.live = self.live, self.live + other.live
        self.kv.merge(other.kv, keep=keep, pad=self.buckets.rows(self.live) - self.live)


def _padded_offsets(offsets, extra: int) -> torch.Tensor | None:
    """Race offsets [n, w, V] (or the callable standing for them, `resolved`) with zeros for `extra` padding rows."""
    offsets = resolved(offsets)
    return None if offsets is None else torch.cat([offsets, offsets.new_zeros(extra, *offsets.shape[1:])])

