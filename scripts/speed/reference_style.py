"""A faithful re-implementation of the reference implementation's decode loop, as a speed baseline.

It mirrors z-lab/dflash `dflash_generate` (batch 1): the target runs with `output_hidden_states=True` (every
layer's hidden states are materialised, then the tapped ones are concatenated), transformers' DynamicCache is
cropped after every verify, acceptance is computed with `.item()` host syncs, and the drafter's context is
recomputed from the accepted positions each cycle (the drafter's context K/V then goes into its cache, as the
reference's draft DynamicCache does). Greedy only (the reference's sampling path checks equality of
a draft with a target sample, which is not the distribution-preserving verifier this project uses).

What this module does not know about: batching, sampling, streaming; it exists to be timed against SpecEngine.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from flashdraft.model.drafter import DFlashDraftModel


@torch.inference_mode()
def reference_style_generate(drafter: DFlashDraftModel, target, input_ids: torch.Tensor, max_new_tokens: int,
                             stop_token_ids: list[int] | None = None, block_size: int | None = None) -> torch.Tensor:
    block_size = block_size or drafter.block_size
    n_prompt = input_ids.shape[1]
    max_length = n_prompt + max_new_tokens
    device = input_ids.device
    output_ids = torch.full((1, max_length + block_size), drafter.mask_token_id, dtype=torch.long, device=device)
    position_ids = torch.arange(output_ids.shape[1], device=device)[None]
    cache = DynamicCache()
    draft_cache = drafter.new_cache(1, max_length + block_size)
    lm_head = target.get_output_embeddings()
    embed = target.get_input_embeddings().weight

    out = target(input_ids, position_ids=position_ids[:, :n_prompt], past_key_values=cache, use_cache=True,
                 logits_to_keep=1, output_hidden_states=True)
    output_ids[:, :n_prompt] = input_ids
    output_ids[:, n_prompt] = out.logits[:, -1].argmax(-1)
    target_hidden = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
    ctx_start = 0
    start = n_prompt
    stops = set(stop_token_ids or [])
    while start < max_length:
        block = output_ids[:, start:start + block_size].clone()
        context_positions = position_ids[:, ctx_start:start]
        drafter.write_context(draft_cache, target_hidden, context_positions, torch.ones_like(context_positions) > 0)
        hidden = drafter.draft(draft_cache, drafter.embed(block, embed), position_ids[:, start:start + block_size],
                               start)
        block[:, 1:] = drafter.compute_logits(hidden[:, 1:], lm_head).argmax(-1)
        out = target(block, position_ids=position_ids[:, start:start + block_size], past_key_values=cache,
                     use_cache=True, output_hidden_states=True)
        posterior = out.logits.argmax(-1)
        accepted = (block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0].item()
        output_ids[:, start:start + accepted + 1] = block[:, :accepted + 1]
        output_ids[:, start + accepted + 1] = posterior[:, accepted]
        new_tokens = output_ids[0, start + 1:start + accepted + 2].tolist()
        ctx_start = start
        start += accepted + 1
        cache.crop(-(cache.get_seq_length() - start))
        target_hidden = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        target_hidden = target_hidden[:, :accepted + 1]
        if stops.intersection(new_tokens):
            cut = next(i for i, t in enumerate(new_tokens) if t in stops)
            start = start - len(new_tokens) + cut + 1
            break
    return output_ids[:, :min(start + 1, max_length)]
