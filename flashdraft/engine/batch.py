"""The live state of a batch between cycles, and the few types the cycle passes around.

- `Features`: target hidden states (the tapped layers, concatenated) of committed slots that the drafter has not
  read yet, with their positions and which of them are real. Each row keeps its own (`PendingContext`) until it
  drafts: a row that only takes one-token steps and finishes so never pays for the drafter's context at all.
- `RowBuckets`: how many rows a paged cache holds for n live rows. Compiled steps see a power-of-two row count
  (`batch_bucket`), so a server whose batch moves between 1 and N rows compiles about log2(N) graphs per step;
  the rows past the live ones are padding whose contents are never read. Both paged caches (the target's and
  the drafter's) pad and unpad through it, so the cycle itself only ever sees live rows.
- `Batch`: the rows, the target's cache, the drafter's per-row state, the draft-length policy. Before every cycle
  (`grow`) each row's caches take pages for its committed tokens plus one block (`row_lengths`); a row that leaves
  gives its pages back, so memory follows the tokens each row holds, not the longest row's or max_tokens.

What this module does not know about: models, drafting, acceptance (the engine, proposers and verifier).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_bucket(n: int) -> int:
    """The row count compiled steps see for n live rows: the next power of two, so a server whose batch size
    moves between 1 and N compiles about log2(N) graphs per step instead of N."""
    return next_power_of_two(n)


def chunked(positions: int, chunk: int) -> int:
    """`positions` rounded up to a whole number of chunks (pages): what a cache holding them allocates."""
    return -(-positions // chunk) * chunk


def zero_pad(x: torch.Tensor, width: int, dim: int, at_end: bool = False) -> torch.Tensor:
    """Zero/False-pad `x` along `dim` to `width`, at the start (default) or at the end."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    zeros = x.new_zeros(shape)
    return torch.cat([x, zeros] if at_end else [zeros, x], dim=dim)


def width_groups(widths: list[int], device) -> list[tuple[int, torch.Tensor]]:
    """The rows of each distinct verify width: [(w, row indices)], widest first."""
    return [(w, torch.tensor([i for i, x in enumerate(widths) if x == w], dtype=torch.long, device=device))
            for w in sorted(set(widths), reverse=True)]


@dataclass(frozen=True)
class RowBuckets:
    bucketed: bool = False

    def rows(self, live: int) -> int:
        """Rows a paged cache holds for `live` live rows."""
        return batch_bucket(live) if self.bucketed and live else live

    def padded_index(self, idx: torch.Tensor) -> torch.Tensor:
        """Row selection `idx` (live rows) extended with padding rows (repeats of a live row: a paged cache gives
        a repeated row no pages)."""
        pad = self.rows(len(idx)) - len(idx)
        return torch.cat([idx, idx[:1].expand(pad)]) if pad else idx

    def pad(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Per-row inputs [live, ...] padded with zero rows to the cache's `rows`."""
        return zero_pad(x, rows, 0, at_end=True)


@dataclass
class Features:
    values: torch.Tensor  # [b, c, n_taps * hidden]
    positions: torch.Tensor  # [b, c]
    valid: torch.Tensor  # [b, c] bool: which of the c slots hold committed tokens of the row

    def pad_rows(self, rows: int) -> "Features":
        return Features(*(zero_pad(t, rows, 0, at_end=True) for t in self.astuple()))

    def astuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.values, self.positions, self.valid


class PendingContext:
    """One row's target features that the drafter has not read yet: those of its consecutive positions from
    `start`, in chunks as they were committed."""

    def __init__(self):
        self.values: list[torch.Tensor] = []  # [c, F] each
        self.start = 0
        self.length = 0

    def add(self, values: torch.Tensor, start: int) -> None:
        """The features [c, F] of positions start .. start + c - 1 (right after what is pending, if anything)."""
        if values.shape[0]:
            if not self.length:
                self.start = start
            self.values.append(values)
            self.length += values.shape[0]

    def take_chunks(self) -> tuple[list[torch.Tensor], int, int]:
        """Everything pending, (its chunks [c_i, F] in order, first position, positions in all), and nothing pending
        after; ([], 0, 0) if nothing was."""
        out = (self.values, self.start, self.length) if self.length else ([], 0, 0)
        self.values, self.length = [], 0
        return out


def take_pending(pending: list[PendingContext], width: int, dtype, device) -> Features:
    """The rows' pending features as one `Features` [b, c, width] (c = the most any row had; shorter rows padded
    with invalid slots at the end), leaving nothing pending. Every row's chunks go in by one concatenation and one
    indexed copy, whatever the rows (per-row copies were three operators a row: launches, on a GPU), and the
    indices reach the device in one copy from the host, as the rows' starts alone did."""
    taken = [p.take_chunks() for p in pending]
    if len(taken) == 1 and taken[0][2]:  # one row (batch 1): its chunks as they are
        chunks, start, n = taken[0]
        return Features(torch.cat(chunks).to(dtype)[None], torch.arange(start, start + n, device=device)[None],
                        torch.ones(1, n, dtype=torch.bool, device=device))
    b, host_lengths = len(pending), torch.tensor([n for _, _, n in taken], dtype=torch.long)
    c = int(host_lengths.max()) if b else 0
    host_offsets = torch.arange(c)[None]
    host_slots = (torch.arange(b)[:, None] * c + host_offsets)[host_offsets < host_lengths[:, None]]
    host_starts = torch.tensor([start for _, start, _ in taken], dtype=torch.long)
    packed = torch.cat([host_starts, host_lengths, host_slots]).to(device)
    starts, lengths, slots = packed[:b], packed[b:2 * b], packed[2 * b:]
    offsets = torch.arange(c, device=device)[None]
    values = torch.zeros(b, c, width, dtype=dtype, device=device)
    chunks = [chunk for row_chunks, _, _ in taken for chunk in row_chunks]
    if chunks:
        values.view(-1, width).index_copy_(0, slots, torch.cat(chunks).to(dtype))
    return Features(values, starts[:, None] + offsets, offsets < lengths[:, None])


@dataclass
class Batch:
    """The live state of a batch: its rows, the target KV cache and what the drafter has not seen yet."""

    rows: list = field(default_factory=list)
    kv: object = None  # the target's cache (`target_kv.py`), live rows only as far as callers can tell
    proposer_state: object = None  # the drafting method's per-row state (e.g. the drafter's context cache)
    policy: object = None  # the draft policy (`policy.py`): each row's verify width per cycle
    block_size: int = 1  # positions one cycle may add to a row (the caches keep room for them)

    def row_lengths(self) -> list[int]:
        """Positions each row may reach in the next cycle: its committed context plus one block."""
        return [r.n_cached + self.block_size for r in self.rows]

    def grow(self, lengths: list[int] | None = None) -> None:
        """Before a cycle: pages for every row's next block (`lengths`: `row_lengths()` unless given). Sliding-window
        layers, the target's and the drafter's, give back the pages no query at a row's committed length or later
        sees (a drafter's pending context written there later goes to the trash page: nothing would read it)."""
        lengths = self.row_lengths() if lengths is None else lengths
        committed = [r.n_cached for r in self.rows]
        self.kv.reserve(lengths, keep_from=committed)
        self.proposer_state.grow(lengths, committed)

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep live rows `idx`, in that order (the others' pages go back to their caches' free lists)."""
        self.rows = [self.rows[i] for i in idx.tolist()]
        self.kv.select_rows(idx)
        self.proposer_state.select_rows(idx)

    def merge(self, other: "Batch") -> None:
        """Append `other`'s rows (freshly prefilled by the same engine) below ours."""
        if not other.rows:
            return
        if not self.rows:  # adopt the newcomers' caches wholesale
            self.rows, self.kv, self.proposer_state = other.rows, other.kv, other.proposer_state
            return
        live = len(self.rows)
        self.rows = self.rows + other.rows
        self.kv.merge(other.kv)
        self.proposer_state.merge(other.proposer_state, live, len(other.rows))
