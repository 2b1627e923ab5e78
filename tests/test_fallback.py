"""The `min_tau` fallback: a batch whose drafts keep fewer than `min_tau` tokens per cycle decodes one-token
steps for a while (8, 16, 32 ... steps between probing drafts). Still lossless, the drafter still sees every
committed position, compiled steps do not recompile after warm-up."""

import pytest
import torch

from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.engine.compiled import compile_unavailable
from flashdraft.engine.policy import MinTauFallback
from tiny import greedy_reference, make_drafter, make_target

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30, 12, 4, 19, 22], list(range(20, 58))]


@pytest.mark.parametrize("arch,fast_path", [("qwen3", None), ("qwen3", False), ("llama", None), ("phi3", None)])
def test_fallback_is_lossless_and_probes_with_growing_gaps(arch, fast_path):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=4)  # random weights: drafts are rarely accepted
    eos = greedy_reference(target, PROMPTS[1], 30)[20]  # a token the target really produces
    params = SamplingParams(max_new_tokens=100, stop_token_ids=(eos,))
    expected = [greedy_reference(target, p, 100, eos) for p in PROMPTS]
    engine = SpecEngine(target, drafter, fast_path=fast_path, min_tau=100.0)  # every draft loses
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == expected
    for r in results:
        assert sum(r.stats.acceptance_lengths) + r.stats.plain_steps == len(r.token_ids) - 1  # + prefill's token
    # without a stop: 3 drafts to judge, then probes after 8, 16, 32 one-token steps: 5-7 drafts for 100 tokens
    alone = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=100))[0]
    assert alone.token_ids == greedy_reference(target, PROMPTS[0], 100)
    assert 5 <= alone.stats.num_drafts <= 7 and alone.stats.plain_steps >= 60, alone.stats
    never = SpecEngine(target, drafter, fast_path=fast_path, min_tau=1.0).generate(PROMPTS, params)
    assert [r.token_ids for r in never] == expected and all(r.stats.plain_steps == 0 for r in never)


def test_min_tau_must_be_at_least_one():
    target = make_target("qwen3")
    for bad in (0.5, -1, "2"):
        with pytest.raises(ValueError, match="min_tau"):
            SpecEngine(target, make_drafter(target), min_tau=bad)


@pytest.mark.parametrize("compile", [False, True])
def test_drafter_sees_the_positions_committed_by_one_token_steps(compile):
    """One-token steps append their target features for the drafter's next call, so after 24 forced one-token
    steps and a draft, the drafter's context cache holds the same K/V for every committed position as the cache
    of an engine that prefilled the whole history as its prompt (dropping them would leave stale slots)."""
    if compile and compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip("no C++ compiler")
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=compile)
    params = SamplingParams(max_new_tokens=60)
    prompt = PROMPTS[1]
    batch = engine.open_batch()
    output = [e.token_ids for e in engine.add(batch, [prompt], params)][0]
    batch.policy = MinTauFallback(1.0)  # never falls back by itself; 24 one-token steps forced
    batch.policy.plain_steps_left = 24
    for _ in range(25):  # 24 one-token steps, then the draft that writes their features
        output += engine.step(batch)[0].token_ids
    assert batch.rows[0].stats.plain_steps == 24 and batch.rows[0].stats.num_drafts == 1
    seen = len(prompt) + 24  # positions committed before the draft: prompt, first token, 23 plain-step tokens
    reference = engine.open_batch()
    engine.add(reference, [prompt + output[:24]], params)
    engine.step(reference)
    ours, theirs = batch.proposer_state.kv, reference.proposer_state.kv
    tol = dict(atol=1e-5, rtol=1e-4)  # compiled kernels round differently from the prefill's eager ones
    for layer in range(len(ours.keys)):
        torch.testing.assert_close(ours.keys[layer][0, :seen], theirs.keys[layer][0, :seen], **tol)
        torch.testing.assert_close(ours.values[layer][0, :seen], theirs.values[layer][0, :seen], **tol)


@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler")
def test_compiled_fallback_warms_up_its_one_token_graphs():
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=True, min_tau=100.0)
    engine.warmup(max_batch_size=2)
    params = SamplingParams(max_new_tokens=40)
    with torch._dynamo.config.patch(error_on_recompile=True):
        results = engine.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in results] == [greedy_reference(target, p, 40) for p in PROMPTS[:2]]
    assert all(r.stats.plain_steps > 0 for r in results)
