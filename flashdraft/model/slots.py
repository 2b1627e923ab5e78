"""KV storage shared by the engine's caches.

- `StaticKV`: preallocated per-layer K/V [batch, capacity, kv_heads, head_dim] where slot p of row r holds
  position p of row r. Writing scatters K/V to the slots of their positions, so rolling back rejected tokens is
  nothing (they sit past the row's length, are masked, and are overwritten) and rows never hold holes. The
  capacity grows (`ensure_capacity`) and shrinks as the caller asks (the engine: in chunks, with the tokens its
  rows hold); it is marked as a dynamic dimension, so compiled steps keep one graph per row count whatever the
  capacity. Rows leaving or joining without changing the row count (a padded batch) are handled in place, so the
  tensors keep their addresses and CUDA graphs replay without re-recording (torch re-records at most 128 times,
  then gives up); a new capacity is a new shape, which CUDA graphs record once per size.
- `compaction_order` / `gather_slots`: for caches that do hold holes (transformers' DynamicCache on the generic
  target path), squeeze the holes out once they are most of the cache.

What this module does not know about: attention, masks, which positions are valid (callers keep lengths).
"""

from __future__ import annotations

import torch


class StaticKV:
    """Per-layer K/V [b, capacity, kv_heads, head_dim]; slot p of row r holds position p of row r."""

    def __init__(self, num_layers, batch, capacity, kv_heads, head_dim, dtype, device):
        shape = (batch, capacity, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._mark_static()

    def _mark_static(self) -> None:
        """CUDA graphs may write these tensors in place only if they are marked as static addresses; the capacity
        (dim 1) is dynamic for torch.compile: growing the cache does not compile another graph."""
        for t in self.keys + self.values:
            torch._dynamo.mark_dynamic(t, 1)
            if t.is_cuda:
                torch._dynamo.mark_static_address(t)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def write(self, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """Store keys/values [b, n, kv_heads, head_dim] of layer `layer` at slots `positions` [b, n] of rows `rows`
        [b] (default: rows 0 .. b-1)."""
        if rows is None:
            rows = torch.arange(positions.shape[0], device=positions.device)
        self.keys[layer][rows[:, None], positions] = keys
        self.values[layer][rows[:, None], positions] = values

    def move_slots(self, rows: torch.Tensor, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy every layer's K/V at slots `source` [b, n] to slots `dest` [b, n] of rows `rows` [b] (a token tree's
        accepted path into consecutive positions; the source is read whole before anything is written)."""
        for t in self.keys + self.values:
            t[rows[:, None], dest] = t[rows[:, None], source]

    def _derived(self, fn) -> "StaticKV":
        """A cache whose K/V tensors are fn(t) of ours (views or copies; no static addresses to mark)."""
        other = StaticKV.__new__(StaticKV)
        other.keys = [fn(t) for t in self.keys]
        other.values = [fn(t) for t in self.values]
        return other

    def row(self, r: int) -> "StaticKV":
        """Row r alone, as a cache of one row sharing this one's memory (writes go through)."""
        return self._derived(lambda t: t[r:r + 1])

    def gather_rows(self, rows: torch.Tensor, length: int) -> "StaticKV":
        """Slots [0, length) of rows `rows`, copied into a cache of their own (for reading only)."""
        return self._derived(lambda t: t[rows, :length])

    def _replace(self, fn) -> None:
        """Every K/V tensor t becomes fn(t) (new tensors: new addresses to mark)."""
        self.keys = [fn(t) for t in self.keys]
        self.values = [fn(t) for t in self.values]
        self._mark_static()

    def ensure_capacity(self, needed: int) -> None:
        """Grow to `needed` slots (callers grow in chunks, so this copies rarely)."""
        if needed > self.capacity:
            grow = needed - self.capacity
            self._replace(lambda t: torch.cat([t, t.new_zeros((t.shape[0], grow, *t.shape[2:]))], dim=1))

    def shrink(self, capacity: int) -> None:
        """Keep slots [0, capacity) only (the caller knows no row needs more)."""
        if capacity < self.capacity:
            self._replace(lambda t: t[:, :capacity].clone())

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep rows `idx`, in that order. In place when the row count stays (see the module docstring)."""
        if idx.numel() == self.batch:
            for t in self.keys + self.values:
                t.copy_(t.index_select(0, idx))
            return
        self._replace(lambda t: t.index_select(0, idx))

    def join_rows(self, keep: int, add: int) -> None:
        """Rows [0, keep) stay, then `add` fresh rows. In place when the row count stays: a fresh row's slots are
        written before they are read (slot = position), so what an earlier occupant left there never shows."""
        if keep + add != self.batch:
            self._replace(lambda t: torch.cat([t[:keep], t.new_zeros((add, *t.shape[1:]))]))

    def merge(self, other: "StaticKV", keep: int | None = None, pad: int = 0) -> None:
        """Rows [0, keep) of self (all by default), then all of other's, then `pad` fresh rows. In place when the
        row count stays and other's rows fit, otherwise one copy."""
        keep = self.batch if keep is None else keep
        rows = slice(keep, keep + other.batch)
        if keep + other.batch + pad == self.batch and other.capacity <= self.capacity:
            for mine, theirs in zip(self.keys + self.values, other.keys + other.values):
                mine[rows, :other.capacity].copy_(theirs)
            return
        self.ensure_capacity(other.capacity)  # both end up max(capacities) wide
        other.ensure_capacity(self.capacity)

        def joined(a, b):
            return torch.cat([a[:keep], b, a.new_zeros((pad, *a.shape[1:]))])

        self.keys = [joined(a, b) for a, b in zip(self.keys, other.keys)]
        self.values = [joined(a, b) for a, b in zip(self.values, other.values)]
        self._mark_static()


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
