"""Drafting methods. Each one proposes the k = block_size - 1 tokens that follow each row's bonus token; the
shared verifier (`verify.py`) decides what is kept.

A method is stateless; what it remembers per row lives in a state object it creates for each live batch
(`new_batch_state()`), which follows the batch's rows through `select_rows(idx)` (rows left),
`join_rows(keep, add)` (rows [0, keep) stay, `add` new rows join below them) and `shrink(capacity)` (no row
needs positions >= capacity any more).

- `DFlashProposer`: the target features of the newly committed positions are written into the drafter's static
  context cache (the batch state, slot = position), then one drafter forward over `[bonus, MASK x k]` per row.
  With `compile=True` (`compiled.py`) features arrive in chunks of one block and the write of the last chunk
  and the draft run as ONE compiled graph (one call, one guard check per cycle).
- `NoProposer`: plain autoregressive decoding (block size 1) through the same engine, the baseline.

What this module does not know about: the target's KV cache and sampling of committed tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdraft.engine.compiled import compile_step
from flashdraft.model.cpu_linear import packed_linear
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.target import TargetModel


@dataclass
class ProposalInput:
    bonus: torch.Tensor  # [b] the last committed token of each row, not yet in the target's cache
    positions: torch.Tensor  # [b, block_size] absolute positions of the block
    new_features: torch.Tensor | None  # [b, c, n_taps * H] target features of positions committed since last call
    new_positions: torch.Tensor | None  # [b, c]
    new_valid: torch.Tensor | None  # [b, c] bool: which of the c slots are real for each row
    histories: list[list[int]]  # committed tokens (prompt + output) per row, bonus included
    request_ids: list  # the request id of each row
    capacity: int  # positions every row of the batch fits in (prompt + max new tokens + a block)
    context_len: int  # the longest committed context of a row (= max position of a bonus token)


class NoRowState:
    """Batch state of a method that remembers nothing per row."""

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def join_rows(self, keep: int, add: int) -> None:
        pass

    def shrink(self, capacity: int) -> None:
        pass


class NoProposer:
    needs_features = False

    def new_batch_state(self) -> NoRowState:
        return NoRowState()

    def propose(self, state, inp: ProposalInput, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return inp.bonus.new_zeros(inp.bonus.shape[0], 0), None


class DraftRows:
    """Batch state of `DFlashProposer`: the drafter's static context cache, allocated at the first draft."""

    def __init__(self):
        self.kv = None

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.kv is not None:
            self.kv.select_rows(rows)

    def join_rows(self, keep: int, add: int) -> None:
        if self.kv is not None:
            self.kv.join_rows(keep, add)

    def shrink(self, capacity: int) -> None:
        """No row needs positions >= capacity any more."""
        if self.kv is not None:
            self.kv.shrink(capacity + 1)  # + the scratch slot


class DFlashProposer:
    """Drafts a block with a DFlash drafter; drafts are the drafter's argmax (one-hot draft distribution)."""

    needs_features = True

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, compile: bool = False,
                 pack_weights: bool = False):
        self.drafter = drafter
        self.target = target
        # the drafter may run in another dtype than the target (e.g. bf16 drafts for an fp32 target on CPU):
        # drafts only steer acceptance, the verifier alone decides the output
        self.embedding_weight = target.embedding_weight.to(drafter.dtype)
        lm_head = target.lm_head
        if lm_head.weight.dtype != drafter.dtype:
            lm_head = copy.deepcopy(lm_head).to(drafter.dtype)
        # CPU: the vocabulary projection through oneDNN on a packed copy (`cpu_linear.py`; the drafter's own
        # projections gained nothing measurable end to end, so they stay as they are)
        self.lm_head = packed_linear(lm_head) if pack_weights else lm_head
        self.compiled = compile
        self._write_step = compile_step(drafter.write_context, drafter.device) if compile else None
        self._draft_step = compile_step(self._draft_tokens, drafter.device) if compile else None

    def new_batch_state(self) -> DraftRows:
        return DraftRows()

    def propose(self, state: DraftRows, inp: ProposalInput, block_size: int) -> tuple[torch.Tensor, None]:
        dev = self.drafter.device
        b = inp.bonus.shape[0]
        if state.kv is None:
            state.kv = self.drafter.new_cache(b, inp.capacity)
        state.kv.ensure_capacity(inp.capacity + 1)  # + the scratch slot
        features, positions, valid = inp.new_features.to(dev), inp.new_positions.to(dev), inp.new_valid.to(dev)
        block = torch.full((b, block_size), self.drafter.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = inp.bonus.to(dev)
        if not self.compiled:
            return self._draft_tokens(state.kv, features, positions, valid, block, inp.positions.to(dev),
                                      inp.context_len).to(inp.bonus.device), None
        # compiled: context arrives in chunks of one block (one static shape, whatever arrived); all but the last
        # chunk (only after a prefill) are written on their own, the last one in the same graph as the draft
        pad = -features.shape[1] % block_size
        if pad:
            features = F.pad(features, (0, 0, 0, pad))
            positions, valid = F.pad(positions, (0, pad)), F.pad(valid, (0, pad))
        dense = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731  (same strides: no recompile)
        chunks = [(dense(features[:, i:i + block_size]), dense(positions[:, i:i + block_size]),
                   dense(valid[:, i:i + block_size])) for i in range(0, features.shape[1], block_size)]
        for chunk in chunks[:-1]:
            self._write_step(state.kv, *chunk)
        drafts = self._draft_step(state.kv, *chunks[-1], block, inp.positions.to(dev), None)
        return drafts.to(inp.bonus.device), None

    def _draft_tokens(self, kv, features, feature_positions, feature_valid, block: torch.Tensor,
                      positions: torch.Tensor, context_len: int | None) -> torch.Tensor:
        """Write the newly committed context into the drafter's cache, then draft one block per row."""
        self.drafter.write_context(kv, features, feature_positions, feature_valid)
        embeds = self.drafter.embed(block, self.embedding_weight)
        hidden = self.drafter.draft(kv, embeds, positions, context_len)
        return self.drafter.compute_logits(hidden[:, 1:], self.lm_head).argmax(dim=-1)
