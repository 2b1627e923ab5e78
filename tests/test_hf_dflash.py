"""Pin the drafter's attention math against transformers' own DFlash implementation.

With the same weights, our drafter's hidden states equal transformers' `MuseGlimmerAssistantModel` on the same
context and block, and during generation every block drafted by our engine equals the block drafted by
`generate(assistant_model=..., speculation_type="dflash")`, cycle by cycle.
"""

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.engine.proposers import DFlashProposer
from flashdraft.model.hf_export import to_transformers_assistant, transformers_dflash_available, transformers_dflash_generate
from tiny import greedy_reference, make_drafter, make_target

pytestmark = pytest.mark.skipif(not transformers_dflash_available(), reason="this transformers has no built-in DFlash")


@pytest.mark.parametrize("block_size", [4, 16])
def test_forward_equals_transformers_assistant(block_size):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=block_size, num_layers=3)
    assistant = to_transformers_assistant(drafter)
    torch.manual_seed(0)
    ctx_len = 11
    ctx = torch.randn(1, ctx_len, len(drafter.target_layer_ids) * 32, dtype=torch.float64)
    noise = torch.randn(1, block_size, 32, dtype=torch.float64)
    ours = drafter(noise, torch.arange(ctx_len, ctx_len + block_size)[None], ctx, torch.arange(ctx_len)[None])
    theirs = assistant(noise_embeds=noise, context_hidden_states=ctx,
                       position_ids=torch.arange(ctx_len + block_size)[None]).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    other = make_drafter(target, block_size=block_size, num_layers=3, seed=99)
    different = other(noise, torch.arange(ctx_len, ctx_len + block_size)[None], ctx, torch.arange(ctx_len)[None])
    assert (different - theirs).abs().max() > 1e-3  # the comparison can fail


def test_drafted_blocks_equal_transformers_dflash(monkeypatch):
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8, num_layers=2)
    prompt = [3, 14, 15, 92, 65, 35]
    theirs, ours = [], []

    original = DFlashTokenCandidateGenerator.get_candidates

    def record_theirs(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            theirs.append(ids[0, input_ids.shape[1]:].tolist())
        return ids, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", record_theirs)
    hf_out = transformers_dflash_generate(target, drafter, torch.tensor([prompt]), 30, do_sample=False,
                                          pad_token_id=0)[0, len(prompt):].tolist()

    original_propose = DFlashProposer.propose

    def record_ours(self, state, inp, block_size):
        drafts, probs = original_propose(self, state, inp, block_size)
        ours.append(drafts[0].tolist())
        return drafts, probs

    monkeypatch.setattr(DFlashProposer, "propose", record_ours)
    # every cycle drafts the drafter's own chain, as transformers' loop does (no prompt-lookup splice)
    engine = SpecEngine(target, drafter, draft_policy="fixed", lookup_splice=0)
    result = engine.generate([prompt], SamplingParams(max_new_tokens=30))[0]
    assert hf_out == result.token_ids == greedy_reference(target, prompt, 30)
    n = min(len(theirs), len(ours))
    assert n >= 5
    assert ours[:n] == theirs[:n]
