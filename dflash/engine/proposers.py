"""Drafting methods. Each one proposes the k = block_size - 1 tokens that follow each row's bonus token; the
shared verifier (`verify.py`) decides what is kept.

A method is stateless; what it remembers per row lives in a state object it creates for each live batch
(`new_batch_state()`), which follows the batch's rows through `select_rows(idx)` (rows left) and `add_rows(n)`
(rows joined at the bottom).

- `DFlashProposer`: the target features of the newly committed positions are written into the drafter's static
  context cache (the batch state, slot = position), then one drafter forward over `[bonus, MASK x k]` per row.
  With `compile=True` both steps are compiled (`compiled.py`); features then arrive in chunks of one block.
- `NoProposer`: plain autoregressive decoding (block size 1) through the same engine, the baseline.

What this module does not know about: the target's KV cache and sampling of committed tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.engine.compiled import compile_step
from dflash.model.drafter import DFlashDraftModel
from dflash.model.target import TargetModel


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

    def add_rows(self, n: int) -> None:
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

    def add_rows(self, n: int) -> None:
        if self.kv is not None:
            self.kv.add_rows(n)


class DFlashProposer:
    """Drafts a block with a DFlash drafter; drafts are the drafter's argmax (one-hot draft distribution)."""

    needs_features = True

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, compile: bool = False):
        self.drafter = drafter
        self.target = target
        # the drafter may run in another dtype than the target (e.g. bf16 drafts for an fp32 target on CPU):
        # drafts only steer acceptance, the verifier alone decides the output
        self.embedding_weight = target.embedding_weight.to(drafter.dtype)
        self.lm_head = target.lm_head
        if target.lm_head.weight.dtype != drafter.dtype:
            self.lm_head = copy.deepcopy(target.lm_head).to(drafter.dtype)
        self.compiled = compile
        self._write_step = compile_step(drafter.write_context, drafter.device) if compile else None
        self._draft_step = compile_step(self._draft_tokens, drafter.device) if compile else self._draft_tokens

    def new_batch_state(self) -> DraftRows:
        return DraftRows()

    def propose(self, state: DraftRows, inp: ProposalInput, block_size: int) -> tuple[torch.Tensor, None]:
        dev = self.drafter.device
        b = inp.bonus.shape[0]
        if state.kv is None:
            state.kv = self.drafter.new_cache(b, inp.capacity)
        state.kv.ensure_capacity(inp.capacity + 1)  # + the scratch slot
        self._write_context(state.kv, inp.new_features.to(dev), inp.new_positions.to(dev), inp.new_valid.to(dev),
                            block_size)
        block = torch.full((b, block_size), self.drafter.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = inp.bonus.to(dev)
        context_len = None if self.compiled else inp.context_len
        return self._draft_step(state.kv, block, inp.positions.to(dev), context_len).to(inp.bonus.device), None

    def _write_context(self, kv, features, positions, valid, block_size: int) -> None:
        if not self.compiled:
            self.drafter.write_context(kv, features, positions, valid)
            return
        pad = -features.shape[1] % block_size  # compiled: one static chunk shape, whatever arrived
        if pad:
            features = F.pad(features, (0, 0, 0, pad))
            positions, valid = F.pad(positions, (0, pad)), F.pad(valid, (0, pad))
        dense = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731  (same strides: no recompile)
        for i in range(0, features.shape[1], block_size):
            chunk = slice(i, i + block_size)
            self._write_step(kv, dense(features[:, chunk]), dense(positions[:, chunk]), dense(valid[:, chunk]))

    def _draft_tokens(self, kv, block: torch.Tensor, positions: torch.Tensor, context_len: int | None):
        embeds = self.drafter.embed(block, self.embedding_weight)
        hidden = self.drafter.draft(kv, embeds, positions, context_len)
        return self.drafter.compute_logits(hidden[:, 1:], self.lm_head).argmax(dim=-1)
