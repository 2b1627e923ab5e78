"""Drafting methods. Each one proposes the k = block_size - 1 tokens that follow each row's bonus token; the
shared verifier (`verify.py`) decides what is kept. A method sees the batch through `ProposalInput` and must keep
its own per-row state in step with the engine's rows (`select_rows`).

- `DFlashProposer`: one drafter forward over `[bonus, MASK x k]`, conditioned on the target features of the
  newly committed positions, which are appended to the drafter's persistent context cache.
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


class NoProposer:
    needs_features = False

    def propose(self, inp: ProposalInput, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return inp.bonus.new_zeros(inp.bonus.shape[0], 0), None

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def reset(self) -> None:
        pass


class DFlashProposer:
    """Drafts a block with a DFlash drafter; drafts are the drafter's argmax (one-hot draft distribution)."""

    needs_features = True

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel):
        self.drafter = drafter
        self.target = target
        self.cache = DraftCache()

    def reset(self) -> None:
        self.cache = DraftCache()

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows.to(self.drafter.device))

    def propose(self, inp: ProposalInput, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        dev = self.drafter.device
        b = inp.bonus.shape[0]
        block = torch.full((b, block_size), self.drafter.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = inp.bonus.to(dev)
        embeds = self.drafter.embed(block, self.target.embedding_weight.to(dev))
        features = inp.new_features.to(dev)
        # padding slots may hold garbage from masked target positions: zero them so no NaN can reach the K/V
        features = features.masked_fill(~inp.new_valid.to(dev)[..., None], 0.0)
        hidden = self.drafter(
            embeds,
            inp.positions.to(dev),
            features,
            inp.new_positions.to(dev),
            inp.new_valid.to(dev),
            cache=self.cache,
        )
        logits = self.drafter.compute_logits(hidden[:, 1:], self.target.lm_head)
        return logits.argmax(dim=-1).to(inp.bonus.device), None
