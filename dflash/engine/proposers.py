"""Drafting methods. Each one proposes the k = block_size - 1 tokens that follow each row's bonus token; the
shared verifier (`verify.py`) decides what is kept.

A method is stateless; what it remembers per row lives in a state object it creates for each live batch
(`new_batch_state()`), which follows the batch's rows through `select_rows(idx)` (rows left) and `add_rows(n)`
(rows joined at the bottom).

- `DFlashProposer`: one drafter forward over `[bonus, MASK x k]`, conditioned on the target features of the
  newly committed positions, which are appended to the drafter's persistent context cache (the batch state).
- `NoProposer`: plain autoregressive decoding (block size 1) through the same engine, the baseline.

What this module does not know about: the target's KV cache and sampling of committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.model.drafter import DFlashDraftModel, DraftCache
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


class DFlashProposer:
    """Drafts a block with a DFlash drafter; drafts are the drafter's argmax (one-hot draft distribution)."""

    needs_features = True

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel):
        self.drafter = drafter
        self.target = target

    def new_batch_state(self) -> DraftCache:
        return DraftCache()

    def propose(self, cache: DraftCache, inp: ProposalInput, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        dev = self.drafter.device
        b = inp.bonus.shape[0]
        block = torch.full((b, block_size), self.drafter.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = inp.bonus.to(dev)
        embeds = self.drafter.embed(block, self.target.embedding_weight.to(dev))
        hidden = self.drafter(
            embeds,
            inp.positions.to(dev),
            inp.new_features.to(dev),
            inp.new_positions.to(dev),
            inp.new_valid.to(dev),
            cache=cache,
        )
        cache.compact()
        logits = self.drafter.compute_logits(hidden[:, 1:], self.target.lm_head)
        return logits.argmax(dim=-1).to(inp.bonus.device), None
