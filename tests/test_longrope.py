"""LongRoPE targets (Phi-3.5, Phi-4-mini, Phi-3-*-128k) on the fast path (`fast_target.LongRope`): every position
gets the frequency set the model's own `generate` gives it (a prompt: the set its length picks; a decoded token:
the set its own position picks), so the output equals the target's own greedy `generate` while verify blocks,
batches and resumed rows cross `original_max_position_embeddings` (32 here, with long factors far from the short
ones, so that the wrong set changes the tokens)."""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from flashdraft import SamplingParams, SpecEngine
from test_preemption import run_with_preemption
from tiny import _COMMON, VOCAB, OracleProposer, greedy_reference, make_drafter

ORIGINAL = 32
# prompts below, at and above the original length; with 40 new tokens every row's positions reach past it
PROMPTS = [[(11 * i + 5 * n) % (VOCAB - 8) + 2 for i in range(n)] for n in (9, 25, 32, 45)]
NEW_TOKENS = 40
_made: dict = {}


def longrope_target():
    """A Phi-4-mini-shaped tiny target: fused q/k/v, 3/4 of the head dimensions rotary, LongRoPE; weights 15x the
    usual scale, so that positions weigh in its choices (at the usual scale its greedy output hardly moves with
    the frequencies)."""
    if "target" not in _made:
        torch.manual_seed(0)
        config = Phi3Config(**{**_COMMON, "max_position_embeddings": 256}, partial_rotary_factor=0.75,
                            initializer_range=0.3, original_max_position_embeddings=ORIGINAL,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                             "short_factor": [1.0, 1.2, 1.5], "long_factor": [4.0, 9.0, 30.0]})
        _made["target"] = Phi3ForCausalLM(config).double().eval()
        _made["expected"] = [greedy_reference(_made["target"], p, NEW_TOKENS) for p in PROMPTS]
    return _made["target"], _made["expected"]


def test_longrope_runs_the_fast_path_with_the_targets_prompt_logits():
    from flashdraft.model.fast_target import fast_path_unsupported

    target, _ = longrope_target()
    assert fast_path_unsupported(target) is None
    engine = SpecEngine(target)
    assert engine.fast is not None and engine.fast.long_rope is not None
    for prompt in PROMPTS:  # each prompt's last logits as transformers' own forward gives them
        ids = torch.tensor([prompt])
        batch = engine.open_batch()
        kv_logits = engine.fast.prefill(ids, torch.arange(len(prompt))[None], engine.fast.new_cache(1, len(prompt)),
                                        torch.tensor([len(prompt)]), capture=False)[0]
        with torch.no_grad():
            reference = target(ids).logits[:, -1]
        torch.testing.assert_close(kv_logits[:, 0], reference, rtol=1e-9, atol=1e-9)
        assert batch.rows == []


@pytest.mark.parametrize("how", ["oracle", "drafter", "plain", "exact", "trees"])
def test_longrope_output_equals_the_targets_generate_across_the_original_length(how):
    """Batches of four rows whose prompts end before, at and after the original length, verify blocks of 8 that
    cross it (an oracle's drafts: long acceptances), a drafter's blocks every cycle, plain decoding, exact mode and
    token trees."""
    target, expected = longrope_target()
    if how == "oracle":
        engine = SpecEngine(target, block_size=8, proposer=OracleProposer([p + e for p, e in zip(PROMPTS, expected)],
                                                                          seed=2))
    elif how == "plain":
        engine = SpecEngine(target)
    else:
        engine = SpecEngine(target, make_drafter(target, block_size=8), draft_policy="fixed",
                            exact=how == "exact", tree_budget=24 if how == "trees" else 0)
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == expected
    if how == "oracle":
        assert 8 in {a for r in results for a in r.stats.acceptance_lengths}


def test_the_frequency_set_decides_the_output(monkeypatch):
    """The test above can fail: one set for every position (short everywhere, long everywhere) or a prompt computed
    with the set of each position rather than of its length gives other tokens than the target's own generate."""
    from flashdraft.model.fast_target import LongRope

    target, expected = longrope_target()
    for original in (10 ** 6, 0):  # never long / always long
        engine = SpecEngine(target)
        engine.fast.long_rope.original = original
        results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert [r.token_ids for r in results] != expected
    by_position = LongRope.__call__
    monkeypatch.setattr(LongRope, "__call__", lambda self, x, positions, floors=None: by_position(self, x, positions))
    results = SpecEngine(target).generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results][3] != expected[3]  # the prompt longer than the original length


def test_resumed_rows_keep_their_prompts_frequency_set():
    """Preempted rows prefilled again (prompt and decoded tokens in one forward) compute the prompt with the set its
    length picks and the decoded tokens with their own, as they were first computed."""
    target, expected = longrope_target()
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    outputs, preemptions = run_with_preemption(engine, PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [outputs[i] for i in range(len(PROMPTS))] == expected
    assert preemptions >= 4


@pytest.mark.parametrize("salted", [True, False], ids=["salted", "one-salt"])
def test_prefix_hits_keep_to_pages_of_their_own_frequency_set(salted, monkeypatch):
    """Prefix caching with pages of both sets in one cache: a prompt shorter than the original length (short pages),
    the same prompt grown past it (its prefill is long: it must not read the short pages), a next turn holding a
    whole first exchange that crossed the length (the row went on in a long chain after its recompute), and the
    short prompt again (a hit on its own pages). Every output equals the target's generate, with hits. With one salt
    for both sets (the test can fail) a long prompt reads short pages and leaves generate."""
    target, _ = longrope_target()
    engine = SpecEngine(target, make_drafter(target, block_size=4), kv_page_size=4, prefix_cache_tokens=512)
    if not salted:
        monkeypatch.setattr(SpecEngine, "_prefix_salt", lambda self, request, prompt, resumed=False: None)
    short = PROMPTS[1]  # 25 tokens
    first = engine.generate([short], SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    rounds = [[short + [7, 8, 9, 10, 11, 12, 13, 14, 15]],  # 34 tokens: long
              [short + first.token_ids + [3, 4]],  # the next turn: 67 tokens
              [short]]
    same, cached = [], 0
    for prompts in rounds:
        results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        same += [r.token_ids == greedy_reference(target, p, NEW_TOKENS) for r, p in zip(results, prompts)]
        cached += sum(r.stats.cached_tokens for r in results)
    if salted:
        assert all(same) and cached > 0
    else:
        assert not all(same)


def test_the_generic_path_warns_that_it_leaves_generate_past_the_original_length():
    target, _ = longrope_target()
    with pytest.warns(UserWarning, match="LongRoPE target on the generic path"):
        assert SpecEngine(target, fast_path=False).fast is None


def test_drafters_for_longrope_targets_take_its_rope_where_the_factors_fit_their_heads():
    """Phi-4-mini rotates 3/4 of each head: its factors do not fit a drafter's fully rotary heads, which get plain
    RoPE at the target's base; a fully rotary LongRoPE target (Phi-3.5-mini) passes its LongRoPE on."""
    from flashdraft.model.drafter import make_draft_config

    target, _ = longrope_target()
    assert make_draft_config(target.config, num_layers=1, mask_token_id=1).rope_parameters == {
        "rope_type": "default", "rope_theta": 1e4}
    full = Phi3Config(**{**_COMMON, "max_position_embeddings": 256}, original_max_position_embeddings=ORIGINAL,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                       "long_factor": [2.0] * 4})
    rope = make_draft_config(full, num_layers=1, mask_token_id=1).rope_parameters
    assert rope["rope_type"] == "longrope" and rope["long_factor"] == [2.0] * 4
    make_drafter(Phi3ForCausalLM(full).double())  # builds


def test_compiled_steps_cross_the_original_length_as_generate():
    """Compiled steps (one width for every row: the shortest room of the rows still below the length) equal the
    target's generate across the boundary, under an oracle's blocks of 8."""
    from flashdraft.engine.compiled import compile_unavailable

    if compile_unavailable(torch.device("cpu")):
        pytest.skip(compile_unavailable(torch.device("cpu")))
    target, expected = longrope_target()
    prompts, expected = [PROMPTS[1], PROMPTS[3]], [expected[1][:24], expected[3][:24]]  # crossing; long from the start
    engine = SpecEngine(target, block_size=8, compile=True,
                        proposer=OracleProposer([p + e for p, e in zip(prompts, expected)], seed=2))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in results] == expected
