"""Logit bias (`SamplingParams.logit_bias`, the server's `logit_bias`): the biased target's own output.

Greedy rows are compared with transformers' `generate` under `sequence_bias` (the same additive bias), sampled rows
with the biased target's own race under the request's noise computed here without an engine; both through drafting
of every acceptance length (an oracle drafter), the DFlash drafter and plain decoding, beside rows without a bias,
on both target paths and on the shipped pair's screened read-out.
"""

from __future__ import annotations

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.engine.noise import exponential_noise, race
from flashdraft.loading import load_pair
from tiny import engine_with, make_drafter, make_target

PROMPTS = [[3, 17, 42, 8, 11], [5, 9], [60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


@torch.inference_mode()
def biased_generate(model, prompt: list[int], max_new: int, bias: dict) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=0, sequence_bias={(t,): b for t, b in bias.items()} or None)
    return out[0, len(prompt):].tolist()


def bias_for(target, prompt: list[int]) -> dict:
    """Bans a token the unbiased target produces and nudges a few others: the biased output differs."""
    free = biased_generate(target, prompt, 12, {})
    return {free[4]: -100.0, 7: 0.5, 50: 0.25, free[0]: -1.0}


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("proposer", ["oracle", "dflash", "none"])
def test_greedy_output_is_the_biased_targets_own(target, fast_path, proposer):
    max_new = 24
    biases = [bias_for(target, PROMPTS[0]), {}, bias_for(target, PROMPTS[2])]
    expected = [biased_generate(target, p, max_new, b) for p, b in zip(PROMPTS, biases)]
    assert expected[0] != biased_generate(target, PROMPTS[0], max_new, {})  # the bias changes the output
    engine = engine_with(proposer, target, PROMPTS, expected, fast_path, seed=4)
    params = [SamplingParams(max_new_tokens=max_new, logit_bias=b) for b in biases]
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected


def test_seeded_sampling_is_the_biased_targets_own_race(target):
    bias = bias_for(target, PROMPTS[0])
    q = SamplingParams(max_new_tokens=16, temperature=0.8, seed=21, logit_bias=bias)
    ids, expected = list(PROMPTS[0]), []
    with torch.inference_mode():
        for j in range(q.max_new_tokens):
            logits = target(torch.tensor([ids])).logits[0, -1].float()
            for t, b in bias.items():
                logits[t] += b
            noise = exponential_noise(torch.tensor([q.seed]), torch.tensor([j]), 1, logits.shape[-1])[0, 0]
            expected.append(int(race(torch.softmax(logits / q.temperature, dim=-1), noise)))
            ids.append(expected[-1])
    for engine in (SpecEngine(target), SpecEngine(target, make_drafter(target, block_size=4))):
        got = engine.generate([PROMPTS[0], PROMPTS[1]], [q, SamplingParams(max_new_tokens=16, temperature=0.8,
                                                                             seed=3)])
        assert got[0].token_ids == expected


def test_log_probabilities_are_the_biased_distributions(target):
    bias = {7: 1.5, 50: -2.0}
    result = SpecEngine(target, make_drafter(target, block_size=4)).generate(
        [PROMPTS[1]], SamplingParams(max_new_tokens=8, logit_bias=bias, logprobs=1))[0]
    with torch.inference_mode():
        logits = target(torch.tensor([PROMPTS[1] + result.token_ids])).logits[0, len(PROMPTS[1]) - 1:-1].double()
        for t, b in bias.items():
            logits[:, t] += b
    reference = torch.log_softmax(logits, dim=-1)
    assert [e.logprob for e in result.logprobs] == pytest.approx(
        [reference[j, t].item() for j, t in enumerate(result.token_ids)], abs=1e-9)


def test_bad_biases_are_refused(target):
    engine = SpecEngine(target)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([PROMPTS[0]], SamplingParams(logit_bias={10**6: 1.0}))
    for bad in ({-1: 1.0}, {3: 101.0}, {3: float("nan")}, "x"):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@torch.inference_mode()
def test_shipped_pair_with_a_bias_keeps_the_full_read_out():
    model, tokenizer, drafter = load_pair(device="cpu", dtype="float32")
    engine = SpecEngine(model, drafter, tokenizer, draft_policy="fixed")
    prompt = tokenizer.encode("def parse(text):\n")
    free = biased_generate(model, prompt, 32, {})
    bias = {free[6]: -100.0, free[1]: -2.0}
    result = engine.generate([prompt, prompt], [SamplingParams(max_new_tokens=32, logit_bias=bias),
                                                SamplingParams(max_new_tokens=32)])
    assert result[0].token_ids == biased_generate(model, prompt, 32, bias) != free
    assert result[1].token_ids == free and result[0].stats.num_drafts > 0
