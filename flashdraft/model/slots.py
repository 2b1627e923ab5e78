"""KV storage shared by the engine's caches.

- `PagedKV`: the K/V of a batch's rows in fixed-size pages. Per layer one pool [pages, page_size, kv_heads,
  head_dim]; a page table [rows, width] names the page that holds positions [j x page_size, (j+1) x page_size) of
  each row, so slot p of row r is slot p % page_size of page table[r, p // page_size]. Rows own pages for the
  positions they hold (`reserve`, as they advance), so memory follows the tokens each row holds, not the longest
  row times the row count; a row that leaves returns its pages to the free list. Writing scatters K/V through the
  table to the slots of their positions, so rolling back rejected tokens is nothing (they sit past the row's
  length, are masked, and are overwritten). Page 0 is the trash page: table entries a row does not own point to it,
  so padding rows (compiled row buckets) and invalid writes land there and nobody reads them.
  Reading (`read`) gathers a row's pages (from a page on, where a sliding-window layer's queries see no earlier
  position) into one dense [rows, length, ...] tensor per layer for SDPA (a view
  without a copy for a single row whose pages are consecutive, the usual batch-1 case): a transient the size of
  the keys attended, the price of a paged layout without a paged-attention kernel. The table's width grows in
  chunks of `TABLE_POSITIONS` and is a dynamic dimension, as is the pool's page count, so compiled steps keep one
  graph per row count; rows leaving or joining without changing the row count and width are handled in place
  (CUDA graphs keep replaying the same addresses). The pool grows by at least an eighth when pages run out
  (amortised copies; never past `max_pages`, a memory budget, unless rows need it) and is compacted when a quarter
  of it is free (checked when rows leave or join, and when pages leave a window). A cache whose layers slide over
  one window gives back the pages that leave it: `reserve(lengths, keep_from)` returns a row's pages wholly before
  keep_from - window + 1 (the engine passes each row's committed length before a cycle: no later query sees
  further back); their table columns point to the trash page, which reads that start at 0 (compiled steps) see
  only where the window masks them.
- `GroupedKV`: layers of different windows (full and sliding, Gemma 2 / 3, gpt-oss) as one `PagedKV` per window,
  each with its own table and pools, so the sliding layers' memory follows their window while the full layers'
  follows the row; `new_paged_cache` picks one or the other.
- `KVBudget`: bytes several caches' pools may take together (a server's memory budget: the target's window groups
  and the drafter's cache; a `GroupedKV` given `max_pages` pages makes one for its groups); a pool short of room
  first makes the others let their free pages go.
- `DenseKV`: a rectangle [rows, length, ...] per layer (gathered rows, for reading only).
- `compaction_order` / `gather_slots`: for caches that do hold holes (transformers' DynamicCache on the generic
  target path), squeeze the holes out once they are most of the cache.

What this module does not know about: attention, masks, which positions are valid (callers keep lengths and say
how many positions each row needs).
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Iterable

import torch

DEFAULT_PAGE_SIZE = 64  # positions per page (`EngineConfig.kv_page_size`)
TABLE_POSITIONS = 256  # the page table's width (positions every row addresses) grows in chunks of this many
TRASH_PAGE = 0
MIN_POOL_GROWTH = 1 / 8  # a pool out of pages grows by at least this fraction: copies stay amortised


def pages_for(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


def window_starts(windows: Iterable[int | None], positions: torch.Tensor, cache) -> dict:
    """{window: the first position its layers read} for queries at `positions`: the keys at k > q - window, from
    the page holding the earliest of them (a window's earlier keys are masked anyway); full attention (None) and,
    while compiling (static shapes), every window: 0."""
    windows = set(windows) - {None}
    if not windows or torch.compiler.is_compiling():
        return dict.fromkeys(windows | {None}, 0)
    page, first = getattr(cache, "page_size", 1), int(positions.min())  # a DenseKV reads from any position
    return {None: 0, **{w: max(0, first - w + 1) // page * page for w in windows}}


class KVBudget:
    """Bytes an engine's paged caches may take together (a server's `--kv-cache-memory`), passed as their
    `max_pages`: a pool grows past what is left only by what its rows need, and a pool short of room first makes the
    others (the target's window groups, the drafter's cache) let their free pages go."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.pools: weakref.WeakSet = weakref.WeakSet()  # the live pools (merged-in caches drop out by themselves)

    def used(self) -> int:
        return sum(pool.pool_bytes() for pool in self.pools)

    def room(self, pool: "PagedKV") -> int:
        """Pages `pool` may grow by beyond what its rows need."""
        if self.used() >= self.limit:
            for other in list(self.pools):
                if other is not pool:
                    other.compact(force=True)
        return (self.limit - self.used()) // (pool.pool_bytes() // pool.pool_pages)


class DenseKV:
    """Per-layer K/V [rows, length, kv_heads, head_dim] (a copy of some rows of a `PagedKV`, for reading)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def page_index(self, length: int | None = None, rows=None, start: int = 0, window: int | None = None):
        return None

    def read(self, layer: int, length: int | None = None, index=None,
             start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        length = length or self.capacity
        return self.keys[layer][:, start:length], self.values[layer][:, start:length]


class PagedKV:
    """Paged per-layer K/V of a batch's rows; see the module docstring."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, dtype, device, page_size: int,
                 lengths: list[int] | None = None, max_pages: "int | KVBudget | None" = None,
                 window: int | None = None):
        self.page_size = page_size
        # growth stops here (a memory budget), unless rows need more: a page count, or a budget shared with others
        self.budget = max_pages if isinstance(max_pages, KVBudget) else None
        self.max_pages = None if self.budget is not None else max_pages
        self.window = window  # every layer's sliding window (None: full attention): `reserve(keep_from=)` trims
        self.table_pages = max(1, TABLE_POSITIONS // page_size)  # the table's width grows by this many pages
        lengths = lengths if lengths is not None else [0] * batch
        pages = 1 + sum(pages_for(n, page_size) for n in lengths)  # + the trash page
        shape = (pages, page_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free = list(range(1, pages))  # a heap: the lowest free page first (a growing row stays consecutive)
        self.pages: list[list[int]] = [[] for _ in range(batch)]  # the host's copy of each row's owned pages
        self.dropped = [0] * batch  # per row: leading table columns whose pages went back (out of the window)
        self.table = torch.zeros((batch, self.table_pages), dtype=torch.long, device=device)
        self._mark_static()
        if self.budget is not None:
            self.budget.pools.add(self)
        self.reserve(lengths)

    def _mark_static(self) -> None:
        """CUDA graphs may write these tensors in place only if they are marked as static addresses; the pool's
        page count and the table's width are dynamic for torch.compile: growing them compiles no other graph."""
        for t in self.keys + self.values:
            torch._dynamo.mark_dynamic(t, 0)
            if t.is_cuda:
                torch._dynamo.mark_static_address(t)
        torch._dynamo.mark_dynamic(self.table, 1)
        if self.table.is_cuda:
            torch._dynamo.mark_static_address(self.table)

    @property
    def capacity(self) -> int:
        """Positions every row's table addresses (a row owns pages for its own positions only)."""
        return self.table.shape[1] * self.page_size

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    @property
    def pool_pages(self) -> int:
        return self.keys[0].shape[0]

    @property
    def held_pages(self) -> int:
        return sum(map(len, self.pages))

    # ---- reading and writing (traceable: tensors and the page size only) --------------------------------------

    def slots(self, positions: torch.Tensor, rows=None, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Flat pool slots [b, n] of `positions` [b, n] in rows `rows` (a tensor [b], or None: rows 0 .. b-1);
        invalid positions (`valid` False) go to the trash page. Computed once, used by every layer's `write`."""
        table = self.table if rows is None else self.table[rows]
        if valid is not None:
            positions = torch.where(valid, positions, 0)
        page = table.gather(1, positions // self.page_size)
        if valid is not None:
            page = torch.where(valid, page, TRASH_PAGE)
        return page * self.page_size + positions % self.page_size

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [b, n, kv_heads, head_dim] of layer `layer` at flat `slots` [b, n] (`slots`)."""
        self.keys[layer].view(-1, *self.keys[layer].shape[2:])[slots] = keys
        self.values[layer].view(-1, *self.values[layer].shape[2:])[slots] = values

    def page_index(self, length: int | None = None, rows=None, start: int = 0, window: int | None = None):
        """What `read` takes for positions [start, length) (`start` a page boundary; default length: the capacity)
        of rows `rows` (a tensor; default: all): the first of those pages (an int) for one row whose pages there are
        consecutive, read as a view; otherwise the page ids [b, n] to gather. Computed once, used by every layer."""
        length = length or self.capacity
        n, first_page = pages_for(length, self.page_size), start // self.page_size
        if rows is None:
            one = 0 if self.batch == 1 else None
        else:
            one = int(rows) if rows.numel() == 1 else None
        if one is not None and not torch.compiler.is_compiling() and first_page >= self.dropped[one]:
            pages = self.pages[one][first_page - self.dropped[one]:n - self.dropped[one]]
            if 0 < len(pages) == n - first_page and pages == list(range(pages[0], pages[0] + len(pages))):
                return pages[0]
        return (self.table if rows is None else self.table[rows])[:, first_page:n]

    def read(self, layer: int, length: int | None = None, index=None,
             start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [b, length - start, kv_heads, head_dim] of positions [start, length) at `index`
        (`page_index` for the page holding `start`, a page boundary; default: every row's)."""
        length = length or self.capacity
        index = self.page_index(length, start=start) if index is None else index
        keys, values = self.keys[layer], self.values[layer]
        if isinstance(index, int):  # consecutive pages: a view, no copy
            n = pages_for(length, self.page_size) - start // self.page_size
            return (keys[index:index + n].view(1, -1, *keys.shape[2:])[:, :length - start],
                    values[index:index + n].view(1, -1, *values.shape[2:])[:, :length - start])
        # index_select, not keys[index]: the same gather, several times faster on CPU
        shape = (index.shape[0], -1, *keys.shape[2:])
        return (keys.index_select(0, index.reshape(-1)).view(shape)[:, :length - start],
                values.index_select(0, index.reshape(-1)).view(shape)[:, :length - start])

    def move_slots(self, rows: torch.Tensor, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy every layer's K/V at positions `source` [b, n] to positions `dest` [b, n] of rows `rows` [b] (a
        token tree's accepted path into consecutive positions; the source is read whole before anything is
        written)."""
        src, dst = self.slots(source, rows), self.slots(dest, rows)
        for t in self.keys + self.values:
            flat = t.view(-1, *t.shape[2:])
            flat[dst] = flat[src]

    def rows(self, idx: list[int]) -> "PagedKV":
        """Rows `idx` alone, as a cache sharing this one's pools (writes go through; for a forward over those rows,
        not for allocating pages)."""
        other = PagedKV.__new__(PagedKV)
        other.__dict__.update(self.__dict__)
        other.table, other.pages = self.table[idx], [self.pages[r] for r in idx]
        other.dropped = [self.dropped[r] for r in idx]
        return other

    def gather_rows(self, rows: torch.Tensor, length: int) -> DenseKV:
        """Positions [0, length) of rows `rows`, copied into a dense cache of their own (for reading only)."""
        index = self.page_index(length, rows)
        read = [self.read(i, length, index) for i in range(len(self.keys))]
        return DenseKV([k for k, _ in read], [v for _, v in read])

    # ---- pages (host side) -----------------------------------------------------------------------------------

    def page_of(self, row: int, column: int) -> int:
        """The pool page holding positions [column x page_size, (column + 1) x page_size) of `row`."""
        if column < self.dropped[row]:
            raise IndexError(f"page {column} of row {row} went back when it left the window")
        return self.pages[row][column - self.dropped[row]]

    def layer_groups(self) -> list[tuple["PagedKV", list[int]]]:
        """(cache, the layers it holds) per page table: this one for all (`GroupedKV`: one per window)."""
        return [(self, list(range(len(self.keys))))]

    def pool_bytes(self, held_only: bool = False) -> int:
        """Bytes of the K/V pools; `held_only`: the pages rows own and the trash page, not the free ones."""
        pool = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        return pool * (self.held_pages + 1) // self.pool_pages if held_only else pool

    def reserve(self, lengths: list[int], keep_from: list[int] | None = None) -> None:
        """Row r owns pages for positions [0, lengths[r]) (pages it already owns stay; rows past the list, e.g.
        padding rows, get nothing). With a window, `keep_from[r]` (the first position row r queries from now on)
        returns the pages wholly before keep_from[r] - window + 1: no query sees them any more; their table entries
        point to the trash page (read only where masked; what is written there is lost, as nothing would read it)."""
        trimmed = self.window is not None and keep_from is not None and self._trim(keep_from)
        if trimmed:  # the pool lets pages go once a quarter of it is free (after a long prompt, most of it)
            self.compact()
        wanted = [pages_for(n, self.page_size) - d - len(p) for n, d, p in zip(lengths, self.dropped, self.pages)]
        missing = sum(w for w in wanted if w > 0)
        if not missing:
            if trimmed:
                self._write_table()
            return
        self._ensure_free(missing)
        for pages, w in zip(self.pages, wanted):
            for _ in range(w):
                pages.append(heapq.heappop(self.free))
        self._write_table()

    def _trim(self, keep_from: list[int]) -> bool:
        trimmed = False
        for r, first in enumerate(keep_from):
            drop = min(max(0, first - self.window + 1) // self.page_size - self.dropped[r], len(self.pages[r]))
            if drop > 0:
                for p in self.pages[r][:drop]:
                    heapq.heappush(self.free, p)
                self.pages[r] = self.pages[r][drop:]
                self.dropped[r] += drop
                trimmed = True
        return trimmed

    def _ensure_free(self, n: int) -> None:
        short = n - len(self.free)
        if short <= 0:
            return
        grow = int(self.pool_pages * MIN_POOL_GROWTH)
        if self.budget is not None:  # a budget: the eighth only as far as it goes
            grow = min(grow, self.budget.room(self))
        elif self.max_pages is not None:
            grow = min(grow, self.max_pages - self.pool_pages)
        grow = max(grow, short)
        old = self.pool_pages
        self._replace(lambda t: torch.cat([t, t.new_zeros((grow, *t.shape[1:]))]))
        for p in range(old, old + grow):
            heapq.heappush(self.free, p)

    def _release(self, rows) -> None:
        for r in rows:
            for p in self.pages[r]:
                heapq.heappush(self.free, p)

    def _write_table(self) -> None:
        """The device table from the host's pages (in place when its shape stays: CUDA graphs keep its address)."""
        most = max((d + len(p) for d, p in zip(self.dropped, self.pages)), default=0)
        width = max(1, -(-most // self.table_pages)) * self.table_pages
        # one tensor from padded lists: a tensor per row cost ~5 us each, ~0.3 ms a cycle at 64 rows
        table = torch.tensor([[TRASH_PAGE] * d + pages + [TRASH_PAGE] * (width - d - len(pages))
                              for d, pages in zip(self.dropped, self.pages)], dtype=torch.long)
        table = table.reshape(len(self.pages), width).to(self.table.device)
        if table.shape == self.table.shape:
            self.table.copy_(table)
        else:
            self.table = table
            self._mark_static()

    def _replace(self, fn) -> None:
        """Every pool tensor t becomes fn(t) (new tensors: new addresses to mark)."""
        self.keys = [fn(t) for t in self.keys]
        self.values = [fn(t) for t in self.values]
        self._mark_static()

    def compact(self, force: bool = False) -> None:
        """When a quarter of the pool is free (`force`: any of it): move the pages in use to the front and let the
        rest go."""
        if self.pool_pages == self.held_pages + 1 or not force and (
                3 * self.pool_pages <= 4 * (self.held_pages + 1) or self.pool_pages <= 8):
            return
        order = [TRASH_PAGE] + [p for pages in self.pages for p in pages]
        index = torch.tensor(order, dtype=torch.long, device=self.table.device)
        self._replace(lambda t: t.index_select(0, index))
        renumber = {old: new for new, old in enumerate(order)}
        self.pages = [[renumber[p] for p in pages] for pages in self.pages]
        self.free = list(range(len(order), self.pool_pages))
        self._write_table()

    # ---- rows leaving and joining ----------------------------------------------------------------------------

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep rows `idx`, in that order; a row selected twice (a padding row of a compiled bucket) keeps its
        pages once and is empty (trash) the other times."""
        chosen = idx.tolist()
        kept, pages, dropped = set(), [], []
        for r in chosen:
            pages.append(self.pages[r] if r not in kept else [])
            dropped.append(self.dropped[r] if r not in kept else 0)
            kept.add(r)
        self._release(r for r in range(len(self.pages)) if r not in kept)
        self.pages, self.dropped = pages, dropped
        self._write_table()
        self.compact()

    def join_rows(self, keep: int, add: int) -> None:
        """Rows [0, keep) stay, then `add` fresh (empty) rows."""
        self._release(range(keep, len(self.pages)))
        self.pages = self.pages[:keep] + [[] for _ in range(add)]
        self.dropped = self.dropped[:keep] + [0] * add
        self._write_table()
        self.compact()

    def merge(self, other: "PagedKV", keep: int | None = None, pad: int = 0) -> None:
        """Rows [0, keep) of self (all by default), then all of other's rows (their pages copied into this pool),
        then `pad` fresh rows."""
        keep = len(self.pages) if keep is None else keep
        self._release(range(keep, len(self.pages)))
        self.pages = self.pages[:keep]
        theirs = [p for pages in other.pages for p in pages]
        self._ensure_free(len(theirs))
        mine = [heapq.heappop(self.free) for _ in theirs]
        if theirs:
            src = torch.tensor(theirs, dtype=torch.long, device=self.table.device)
            dst = torch.tensor(mine, dtype=torch.long, device=self.table.device)
            for a, b in zip(self.keys + self.values, other.keys + other.values):
                a[dst] = b.index_select(0, src)
        renumber = dict(zip(theirs, mine))
        self.pages += [[renumber[p] for p in pages] for pages in other.pages] + [[] for _ in range(pad)]
        self.dropped = self.dropped[:keep] + other.dropped + [0] * pad
        self._write_table()


class GroupedKV:
    """Layers with different sliding windows (Gemma 2 / 3, gpt-oss, Qwen's `layer_types`): one `PagedKV` per
    window, each with its own page table and pools, so a windowed group's rows hold only the pages its window
    reaches (`reserve(keep_from=)`) while full-attention layers hold every position. The `PagedKV` interface:
    `slots` gives one tensor per group (`write` picks its layer's), `page_index` takes the window whose table
    to index, layers are numbered as the model's."""

    def __init__(self, windows: list[int | None], batch: int, kv_heads: int, head_dim: int, dtype, device,
                 page_size: int, lengths: list[int] | None = None, max_pages: "int | KVBudget | None" = None):
        order = list(dict.fromkeys(windows))
        self.group_of = [order.index(w) for w in windows]
        self.local = [self.group_of[:i].count(g) for i, g in enumerate(self.group_of)]
        self.by_window = {w: g for g, w in enumerate(order)}
        if isinstance(max_pages, int):  # this many pages of every layer: the groups' pools together
            page = 2 * len(windows) * page_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
            max_pages = KVBudget(max_pages * page)
        self.groups = [PagedKV(self.group_of.count(g), batch, kv_heads, head_dim, dtype, device, page_size, lengths,
                               max_pages, window=w) for g, w in enumerate(order)]

    def _with_groups(self, groups: list[PagedKV]) -> "GroupedKV":
        other = GroupedKV.__new__(GroupedKV)
        other.__dict__.update(self.__dict__)
        other.groups = groups
        return other

    page_size = property(lambda self: self.groups[0].page_size)
    capacity = property(lambda self: self.groups[0].capacity)
    batch = property(lambda self: self.groups[0].batch)
    held_pages = property(lambda self: sum(g.held_pages for g in self.groups))
    pool_pages = property(lambda self: sum(g.pool_pages for g in self.groups))
    keys = property(lambda self: self._by_layer([g.keys for g in self.groups]))
    values = property(lambda self: self._by_layer([g.values for g in self.groups]))

    def _by_layer(self, per_group: list[list]) -> list:
        """Per-group lists of per-layer items (each group's layers in its order) as one list in the model's order."""
        return [per_group[g][j] for g, j in zip(self.group_of, self.local)]

    def layer_groups(self) -> list[tuple[PagedKV, list[int]]]:
        return [(group, [i for i, g in enumerate(self.group_of) if g == n]) for n, group in enumerate(self.groups)]

    def pool_bytes(self, held_only: bool = False) -> int:
        return sum(g.pool_bytes(held_only) for g in self.groups)

    def slots(self, positions: torch.Tensor, rows=None, valid: torch.Tensor | None = None) -> tuple:
        return tuple(g.slots(positions, rows, valid) for g in self.groups)

    def write(self, layer: int, slots: tuple, keys: torch.Tensor, values: torch.Tensor) -> None:
        g = self.group_of[layer]
        self.groups[g].write(self.local[layer], slots[g], keys, values)

    def page_index(self, length: int | None = None, rows=None, start: int = 0, window: int | None = None):
        return self.groups[self.by_window[window]].page_index(length, rows, start)

    def read(self, layer: int, length: int | None = None, index=None,
             start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.groups[self.group_of[layer]].read(self.local[layer], length, index, start)

    def move_slots(self, rows: torch.Tensor, source: torch.Tensor, dest: torch.Tensor) -> None:
        for g in self.groups:
            g.move_slots(rows, source, dest)

    def rows(self, idx: list[int]) -> "GroupedKV":
        return self._with_groups([g.rows(idx) for g in self.groups])

    def gather_rows(self, rows: torch.Tensor, length: int) -> DenseKV:
        dense = [g.gather_rows(rows, length) for g in self.groups]
        return DenseKV(self._by_layer([d.keys for d in dense]), self._by_layer([d.values for d in dense]))

    def reserve(self, lengths: list[int], keep_from: list[int] | None = None) -> None:
        for g in self.groups:
            g.reserve(lengths, keep_from)

    def select_rows(self, idx: torch.Tensor) -> None:
        for g in self.groups:
            g.select_rows(idx)

    def join_rows(self, keep: int, add: int) -> None:
        for g in self.groups:
            g.join_rows(keep, add)

    def merge(self, other: "GroupedKV", keep: int | None = None, pad: int = 0) -> None:
        for mine, theirs in zip(self.groups, other.groups):
            mine.merge(theirs, keep, pad)

    def compact(self) -> None:
        for g in self.groups:
            g.compact()


def new_paged_cache(windows: list[int | None], batch: int, kv_heads: int, head_dim: int, dtype, device,
                    page_size: int, lengths: list[int] | None = None, max_pages: int | None = None):
    """The cache for layers with these sliding windows (None: full attention): one `PagedKV` where they all
    share one (trimmed to it where that is a window), else a `GroupedKV`."""
    if len(set(windows)) == 1:
        return PagedKV(len(windows), batch, kv_heads, head_dim, dtype, device, page_size, lengths, max_pages,
                       window=windows[0])
    return GroupedKV(windows, batch, kv_heads, head_dim, dtype, device, page_size, lengths, max_pages)


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
