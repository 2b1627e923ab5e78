"""Presence, frequency and repetition penalties (`SamplingParams`, the server's fields of the same names).

The reference is the target itself: transformers' `generate(repetition_penalty=...)` for the repetition penalty
(it counts prompt and output, as vLLM's does), and for presence and frequency penalties, which transformers does not
have, the target's forward over the text so far with the penalties' definitions applied, one token at a time
(greedy: argmax; sampled: the race under the request's noise). The engine must reach the same text through drafting
of every acceptance length (an oracle drafter), where each block position's penalties count the drafts before it.
"""

from __future__ import annotations

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.engine.noise import exponential_noise, race
from flashdraft.loading import load_pair
from tiny import OracleProposer, make_drafter, make_target

PROMPTS = [[3, 17, 42, 8, 11, 3, 3], [5, 9], [60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


@torch.inference_mode()
def reference(model, prompt: list[int], q: SamplingParams) -> list[int]:
    """The target's own continuation under q's penalties, one forward per token."""
    out = []
    for j in range(q.max_new_tokens):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).double()
        seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=logits.shape[-1]) > 0)
        rp = q.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        logits = logits - q.frequency_penalty * counts - q.presence_penalty * (counts > 0).double()
        if q.greedy:
            out.append(int(logits.argmax()))
        else:
            noise = exponential_noise(torch.tensor([q.seed]), torch.tensor([j]), 1, logits.shape[-1])[0, 0]
            out.append(int(race(torch.softmax(logits.float() / q.temperature, dim=-1), noise)))
    return out


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.2),
    "all, negative": dict(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=0.8),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
def test_greedy_with_penalties_is_the_targets_own(target, case, fast_path):
    params = [SamplingParams(max_new_tokens=24, **CASES[case]), SamplingParams(max_new_tokens=24),
              SamplingParams(max_new_tokens=24, **CASES[case])]
    expected = [reference(target, p, q) for p, q in zip(PROMPTS, params)]
    assert expected[0] != reference(target, PROMPTS[0], params[1])  # the penalty changes the text
    engines = [SpecEngine(target, block_size=8, fast_path=fast_path, draft_policy="fixed",
                          proposer=OracleProposer([p + e for p, e in zip(PROMPTS, expected)], corrupt=0.5, seed=6)),
               SpecEngine(target, make_drafter(target, block_size=8), fast_path=fast_path)]
    for engine in engines:
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected
    assert max(engines[0].generate(PROMPTS, params)[0].stats.acceptance_lengths) >= 4  # drafts were counted


def test_repetition_penalty_equals_transformers_generate(target):
    ids = torch.tensor([PROMPTS[0]])
    want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                           pad_token_id=0, repetition_penalty=1.8)[0, len(PROMPTS[0]):].tolist()
    assert want == reference(target, PROMPTS[0], SamplingParams(max_new_tokens=24, repetition_penalty=1.8))
    got = SpecEngine(target, make_drafter(target, block_size=8)).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=24, repetition_penalty=1.8))[0]
    assert got.token_ids == want


def test_seeded_sampling_with_penalties_is_the_targets_own_race(target):
    q = SamplingParams(max_new_tokens=16, temperature=0.9, seed=8, frequency_penalty=1.0, repetition_penalty=1.3)
    expected = reference(target, PROMPTS[0], q)
    for engine in (SpecEngine(target), SpecEngine(target, make_drafter(target, block_size=4))):
        assert engine.generate([PROMPTS[0], PROMPTS[1]], [q, SamplingParams(max_new_tokens=16)])[0].token_ids == \
            expected


@pytest.mark.parametrize("name,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                                        ("repetition_penalty", True)])
def test_out_of_range_penalties_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@torch.inference_mode()
def test_shipped_pair_with_a_repetition_penalty_equals_generate():
    """The shipped target loops (`#\\n#\\n...`) after this prompt; a repetition penalty breaks the loop the way
    transformers' does, through the fast path (its screened read-out off for the row)."""
    model, tokenizer, drafter = load_pair(device="cpu", dtype="float32")
    prompt = tokenizer.encode("def build(dtype, device):\n")
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          pad_token_id=0, repetition_penalty=1.3)[0, len(prompt):].tolist()
    engine = SpecEngine(model, drafter, tokenizer, draft_policy="fixed")
    assert engine.generate([prompt], SamplingParams(max_new_tokens=32, repetition_penalty=1.3))[0].token_ids == want
