"""A reduced draft vocabulary: the drafter reads out over the N most frequent target tokens only.

Layout (EAGLE-3's, which vLLM's DFlash and EAGLE-3 loaders read): the config states `draft_vocab_size` N, the
checkpoint ships the drafter's own `lm_head.weight` [N, hidden] and `d2t` [N] (int64 offsets): draft id d stands for
target id `d + d2t[d]`. Draft ids are the chosen target ids in increasing order, so `d2t` is non-decreasing.

- `count_tokens` / `select_draft_vocab`: which ids to keep, from token frequencies (the response tokens a drafter
  is trained to predict); ties go to the lower id, so the choice is deterministic.
- `restrict_drafter`: a full-vocabulary drafter turned into one with a reduced vocabulary whose head is those rows
  of the target's lm_head: exactly the old drafter, except that ids outside the draft vocabulary are never drafted.
  Training (`flashdraft train --draft-vocab-size N`) starts from the same head and trains it.
- `copy_weights`: the weights two drafters share (everything but the read-out), for the above and for
  `flashdraft train --init-from`.

Drafting with a reduced vocabulary changes only which tokens are proposed; the verifier is unchanged, so greedy
output and the sampled distribution stay the target's.

What this module does not know about: the engine (`DFlashProposer` maps draft ids to target ids) and training.
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch


def count_tokens(sequences: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64 counts of the token ids in `sequences`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long).reshape(-1), minlength=vocab_size)[:vocab_size]
    return counts


def response_token_counts(examples, vocab_size: int) -> torch.Tensor:
    """Counts of the tokens a drafter learns to predict: the response (loss) tokens of training `Example`s."""
    return count_tokens((e.input_ids[e.loss_mask] for e in examples), vocab_size)


def select_draft_vocab(counts, size: int) -> torch.Tensor:
    """The `size` most frequent ids of `counts` (ties: lower id first), in increasing order."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    # a stable sort on -count keeps ids of equal count in increasing order
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:size]).values


def d2t_offsets(draft_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's `d2t`: target id of draft id d minus d."""
    return draft_ids.long() - torch.arange(draft_ids.numel(), dtype=torch.long, device=draft_ids.device)


def draft_targets(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id: d + d2t[d]."""
    return torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device) + d2t.long()


def copy_weights(source: torch.nn.Module, dest: torch.nn.Module, skip: tuple[str, ...] = ("lm_head.", "d2t"),
                 may_lack: tuple[str, ...] = ()) -> None:
    """Copy every weight of `source` into `dest` except those whose names start with `skip`; a weight missing in
    `source` or of another shape raises ValueError naming it, unless its name contains one of `may_lack` and
    `source` has no such weight at all (then `dest` keeps its own: a DFlash2 drafter started from a DFlash-1 one)."""
    src = source.state_dict()
    with torch.no_grad():
        for name, tensor in dest.state_dict().items():
            if name.startswith(skip) or name.startswith("rotary_emb."):
                continue
            if name not in src and any(part in name for part in may_lack):
                continue
            if name not in src or tuple(src[name].shape) != tuple(tensor.shape):
                got = "missing" if name not in src else f"shape {tuple(src[name].shape)}"
                raise ValueError(f"cannot initialise {name} {tuple(tensor.shape)} from the source drafter ({got})")
            tensor.copy_(src[name].to(tensor.dtype))


def set_draft_vocab(drafter, head_weight: torch.Tensor, draft_ids: torch.Tensor) -> None:
    """Point a drafter built with `draft_vocab_size` = len(draft_ids) at those target ids: `d2t` from the ids, its
    own lm_head = the rows `draft_ids` of `head_weight` (the target's lm_head, [vocab, hidden])."""
    with torch.no_grad():
        drafter.d2t.copy_(d2t_offsets(draft_ids).to(drafter.d2t.device))
        drafter.lm_head.weight.copy_(head_weight.detach()[draft_ids.to(head_weight.device)].to(
            drafter.lm_head.weight.device, drafter.lm_head.weight.dtype))


def reduced_config(config, size: int):
    """A copy of a drafter config with `draft_vocab_size` = size."""
    config = copy.deepcopy(config)
    config.draft_vocab_size = int(size)
    return config


def restrict_drafter(drafter, head_weight: torch.Tensor, draft_ids: torch.Tensor):
    """A new drafter with the weights of the full-vocabulary `drafter`, reading out over `draft_ids` only through
    those rows of `head_weight` (the target's lm_head)."""
    from flashdraft.model.drafter import DFlashDraftModel

    if drafter.d2t is not None or drafter.lm_head is not None:
        raise ValueError("restrict_drafter needs a drafter that reads out through the target's lm_head")
    small = DFlashDraftModel(reduced_config(drafter.config, draft_ids.numel()), own_lm_head=True,
                             mask_embedding=drafter.mask_embedding is not None)
    small.to(device=drafter.device, dtype=drafter.dtype)
    copy_weights(drafter, small)
    set_draft_vocab(small, head_weight, draft_ids)
    return small.eval()
