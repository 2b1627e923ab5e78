"""Automatic prefix caching: what the target computed for the full pages of prompts and answers, reused by later
prompts that begin with the same tokens (a shared system prompt, few-shot examples, a conversation's earlier turns).

Design:
- The unit is one page of a prompt or answer (`kv_page_size` positions, the paged caches' page): the target's K/V
  of every layer at those positions and, when the drafter reads them, the tapped layers' features there (the
  drafter's context for those positions is then built from them as from a prefill's).
- A page's key is (the id of the page before it, its tokens): a hit on page j means pages 0 .. j match token for
  token (exact keys, no hash to collide). A prompt's match is its longest chain of cached pages that leaves at
  least its last token to compute: that token's logits give the first output token. A salt (vLLM's `cache_salt`)
  stands before a chain's first page: prompts find only pages of prompts with the same salt.
- Copies, not shared pages: the cache holds its pages in a store of its own, and a hit copies them into the row's
  own pages (one indexed copy per layer's K and V). Rows own their pages exactly as without the cache, so growth,
  compaction, merges, preemption and compiled steps know nothing of it; the price is the copy (far below the
  forward it replaces) and the store's memory, bounded by `max_pages`.
- A prompt's pages go in after the forward that computed them (`insert`), an answer's as decoding fills them
  (`extend`, after the prompt's chain); least recently used pages leave first, a chain's last pages before its
  first (every hit, insert and extension touches its chain from its end back to its start), so what stays is
  reachable.

What this module does not know about: rows, batches, requests, or when caching is exact (the engine uses it on
the fast path outside exact mode, where a prefill is computed in chunks of any size anyway); it maps token
sequences to store pages and copies tensors between the store and a `PagedKV`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flashdraft.model.slots import PagedKV

# the store is allocated as pages come: MIN_STORE_PAGES first, then GROWTH times what it holds, up to max_pages
MIN_STORE_PAGES, GROWTH = 16, 2


@dataclass
class PrefixHit:
    """A prompt's cached start: `slots` = the store pages of its first len(slots) pages (positions [0, tokens))."""

    slots: list[int]
    page_size: int

    @property
    def tokens(self) -> int:
        return len(self.slots) * self.page_size


NO_HIT = PrefixHit([], 1)


@dataclass
class _Copies:
    """An insert's planned copies: (row, page column) of the cache -> store slots (with their features), and the
    pages it found or made (none of them leaves to make room for another)."""

    pages: list[tuple[int, int]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)
    kept: set[int] = field(default_factory=set)


def _root(salt: str | None):
    """What stands before a chain's first page: 0 (page ids start at 1), or the salt."""
    return 0 if salt is None else ("salt", salt)


class PrefixCache:
    """Full pages of prompts and answers by their tokens (see the module docstring). `queries` / `hits`: prompt
    tokens looked up and found (vLLM's prefix-cache counters)."""

    def __init__(self, page_size: int, max_pages: int):
        if max_pages < 1:
            raise ValueError(f"a prefix cache needs room for at least one page, got max_pages={max_pages}")
        self.page_size = page_size
        self.max_pages = max_pages
        self.keys: list[torch.Tensor] = []  # per layer [store pages, page_size, kv_heads, head_dim]
        self.values: list[torch.Tensor] = []
        self.features: torch.Tensor | None = None  # [store pages, page_size, F] (None: the drafter reads none)
        self.index: dict[tuple, int] = {}  # (parent page id, or a chain's root, tokens) -> page id
        self.pages: OrderedDict[int, tuple[tuple, int]] = OrderedDict()  # page id -> (key, store slot)
        self.free: list[int] = []
        self.next_id = 1  # page ids are never reused: a child of an evicted page can never be reached again
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self.pages)

    def clear(self) -> None:
        """Forget every page (the store's memory stays allocated)."""
        self.index.clear()
        self.pages.clear()
        self.free = list(range(self.keys[0].shape[0])) if self.keys else []

    # ---- looking up ------------------------------------------------------------------------------------------

    def _chain(self, tokens: Sequence[int], salt: str | None) -> list[int]:
        """Page ids of the longest cached chain of `tokens`' full pages, leaving at least the last token out."""
        ids, parent, size = [], _root(salt), self.page_size
        for j in range((len(tokens) - 1) // size):
            page = self.index.get((parent, tuple(tokens[j * size:(j + 1) * size])))
            if page is None:
                break
            ids.append(page)
            parent = page
        return ids

    def cached_tokens(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """How many of `tokens`' first positions a `match` would find now (nothing counted or touched)."""
        return len(self._chain(tokens, salt)) * self.page_size

    def match(self, tokens: Sequence[int], salt: str | None = None) -> PrefixHit:
        """The cached start of `tokens` (under `salt`); counted in `queries` / `hits` and touched as recently
        used."""
        ids = self._chain(tokens, salt)
        if ids:
            self._touch(ids[-1])
        self.queries += len(tokens)
        self.hits += len(ids) * self.page_size
        return PrefixHit([self.pages[page][1] for page in ids], self.page_size)

    def load(self, kv: PagedKV, rows: Sequence[int], hits: Sequence[PrefixHit]) -> None:
        """Copy each hit's pages into the first pages of its row of `kv` (which owns pages for them already)."""
        columns = [(r, j) for r, hit in zip(rows, hits) for j in range(len(hit.slots))]
        if not columns:
            return
        src = torch.tensor([s for hit in hits for s in hit.slots], dtype=torch.long, device=self.keys[0].device)
        for cache, layers in kv.layer_groups():
            dst = torch.tensor([cache.page_of(r, j) for r, j in columns], dtype=torch.long, device=src.device)
            for n, i in enumerate(layers):
                cache.keys[n].index_copy_(0, dst, self.keys[i].index_select(0, src))
                cache.values[n].index_copy_(0, dst, self.values[i].index_select(0, src))

    def prefix_features(self, hit: PrefixHit) -> torch.Tensor | None:
        """The tapped features [hit.tokens, F] of a hit's positions (None without features or a hit)."""
        if self.features is None or not hit.slots:
            return None
        index = torch.tensor(hit.slots, dtype=torch.long, device=self.features.device)
        return self.features.index_select(0, index).flatten(0, 1)

    # ---- storing ---------------------------------------------------------------------------------------------

    def insert(self, kv: PagedKV, rows: Sequence[int], prompts: Sequence[Sequence[int]],
               features: Sequence[torch.Tensor | None] | None = None,
               salts: Sequence[str | None] | None = None) -> list[object | None]:
        """After a forward computed `prompts` into rows `rows` of `kv` (features[i]: row i's [len(prompt), F], or
        None; salts[i]: its salt): their full pages not cached yet go in. Returns each row's chain end, where
        `extend` goes on (None where the store could not take every full page)."""
        copies = _Copies()
        ends = [self._link(copies, kv, row, _root(salts[i] if salts is not None else None), tokens, 0,
                           features[i] if features is not None else None)
                for i, (row, tokens) in enumerate(zip(rows, prompts))]
        self._copy(kv, copies)
        return ends

    def extend(self, kv: PagedKV, row: int, end, tokens: Sequence[int], first: int,
               features: torch.Tensor | None) -> object | None:
        """Pages `first` .. len(tokens) // page_size - 1 of a row whose chain ends at `end` (`insert`'s, or the last
        `extend`'s), as decoding fills them: `tokens` are the row's from position 0, `features` those of positions
        first x page_size on. Returns the new end (None: the chain left the cache, or the store is full of it)."""
        if end is None or (isinstance(end, int) and end and end not in self.pages):
            return None
        copies = _Copies()
        end = self._link(copies, kv, row, end, tokens, first, features)
        self._copy(kv, copies)
        return end

    def _link(self, copies: "_Copies", kv: PagedKV, row: int, parent, tokens: Sequence[int], first: int,
              features: torch.Tensor | None) -> object | None:
        """The row's full pages from `first` on, under `parent`: found ones touched, new ones given store pages
        (their copies planned in `copies`). Returns the last page's id, or None if the store ran out."""
        size = self.page_size
        for j in range(first, len(tokens) // size):
            key = (parent, tuple(tokens[j * size:(j + 1) * size]))
            page = self.index.get(key)
            if page is None:
                slot = self._take_slot(kv, features, copies.kept)
                if slot is None:
                    parent = None
                    break
                page = self.next_id
                self.next_id += 1
                self.index[key] = page
                self.pages[page] = (key, slot)
                copies.pages.append((row, j))
                copies.slots.append(slot)
                if self.features is not None:
                    copies.features.append(features[(j - first) * size:(j - first + 1) * size])
            copies.kept.add(page)
            parent = page
        self._touch(parent)
        return parent

    def _touch(self, end) -> None:
        """The chain ending at page `end`, touched from its end back to its start: the start is then the most
        recently used, and pages leave a chain from its end (none is left unreachable behind an evicted one)."""
        while isinstance(end, int) and end in self.pages:  # a root (0 or a salt) ends the walk
            self.pages.move_to_end(end)
            end = self.pages[end][0][0]

    def _copy(self, kv: PagedKV, copies: "_Copies") -> None:
        if not copies.slots:
            return
        dst = torch.tensor(copies.slots, dtype=torch.long, device=self.keys[0].device)
        for cache, layers in kv.layer_groups():
            src = torch.tensor([cache.page_of(r, j) for r, j in copies.pages], dtype=torch.long, device=dst.device)
            for n, i in enumerate(layers):
                self.keys[i].index_copy_(0, dst, cache.keys[n].index_select(0, src))
                self.values[i].index_copy_(0, dst, cache.values[n].index_select(0, src))
        if self.features is not None:
            self.features.index_copy_(0, dst.to(self.features.device), torch.stack(copies.features))

    def _take_slot(self, kv: PagedKV, features: torch.Tensor | None, kept: set[int]) -> int | None:
        """A free store page: the store is made or grown if it may, else the least recently used page not in
        `kept` leaves. None if every page is kept."""
        if not self.free:
            self._grow(kv, features)
        if self.free:
            return self.free.pop()
        for page, (key, slot) in self.pages.items():
            if page not in kept:
                del self.pages[page]
                del self.index[key]
                return slot
        return None

    def _grow(self, kv: PagedKV, features: torch.Tensor | None) -> None:
        have = self.keys[0].shape[0] if self.keys else 0
        want = min(self.max_pages, max(MIN_STORE_PAGES, have * GROWTH))
        if want <= have:
            return

        def grown(old: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            new = like.new_zeros((want, *like.shape[1:]))
            if old is not None:
                new[:have] = old
            return new

        shape = (1, self.page_size, *kv.keys[0].shape[2:])
        self.keys = [grown(self.keys[i] if have else None, kv.keys[i].new_empty(shape)) for i in range(len(kv.keys))]
        self.values = [grown(self.values[i] if have else None, kv.values[i].new_empty(shape))
                       for i in range(len(kv.values))]
        if features is not None or self.features is not None:
            like = (features if features is not None else self.features)
            self.features = grown(self.features, like.new_empty((1, self.page_size, like.shape[-1])))
        self.free.extend(range(want - 1, have - 1, -1))  # popped from the end: the lowest first
