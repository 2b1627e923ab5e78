"""Preemption and recompute (`SpecEngine.preempt` / `resume`): a row taken out of a batch mid-generation and brought
back later, its prompt and output prefilled again, ends with the output it would have had uninterrupted: the
target's greedy output (fast and generic paths), bit for bit plain decoding's in exact mode, and a seeded sampled
row's very tokens (counter-based noise)."""

from __future__ import annotations

import pytest

from flashdraft.engine import SamplingParams, SpecEngine
from test_exact import _prompts, _target
from tiny import cache_row, greedy_reference, make_drafter, make_target

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30, 12, 4, 19, 22], list(range(20, 58)), [70, 71, 1, 1, 2]]


def run_with_preemption(engine: SpecEngine, prompts, params) -> tuple[dict, int]:
    """Generate with rows preempted and resumed: every other row out at cycle 2 and back at cycle 5 (into a
    running batch), then every row out at cycle 8 and back at cycle 9 (into an empty batch). Returns the outputs
    by row and how many preemptions happened."""
    batch = engine.open_batch()
    outputs: dict = {}
    parked, preemptions = [], 0

    def collect(events):
        for ev in events:
            outputs.setdefault(ev.index, []).extend(ev.token_ids)

    collect(engine.add(batch, prompts, params, request_ids=list(range(len(prompts)))))
    cycle = 0
    while batch.rows or parked:
        if cycle in (2, 8):
            for r in [r.index for r in batch.rows][::1 if cycle == 8 else 2]:
                parked.append(engine.preempt(batch, r))
            preemptions += len(parked)
        if cycle in (5, 9) or (parked and not batch.rows and cycle > 9):
            engine.resume(batch, parked)
            parked = []
        if batch.rows:
            collect(engine.step(batch))
        cycle += 1
    return outputs, preemptions


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "generic"])
def test_preempted_rows_end_with_the_targets_greedy_output(fast_path):
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4), fast_path=fast_path)
    expected = [greedy_reference(target, p, 30) for p in PROMPTS]
    outputs, preemptions = run_with_preemption(engine, PROMPTS, SamplingParams(max_new_tokens=30))
    assert [outputs[i] for i in range(len(PROMPTS))] == expected
    assert preemptions >= 4
    assert engine.preempt(engine.open_batch(), "nobody") is None


def test_preempted_rows_stay_plain_decoding_bit_for_bit_in_exact_mode():
    """Exact mode: the resumed rows' decoded positions are recomputed through the exact forward, as verification
    computed them, so the output is still plain decoding's bit for bit (bf16: a recompute as a prompt block would
    round differently)."""
    import torch

    model = _target(torch.bfloat16)
    prompts = _prompts(6, seed=3)
    params = SamplingParams(max_new_tokens=40)
    plain = SpecEngine(model, exact=True).generate(prompts, params)
    engine = SpecEngine(model, make_drafter(model, block_size=8, dtype=torch.bfloat16), exact=True)
    outputs, _ = run_with_preemption(engine, prompts, params)
    assert [outputs[i] for i in range(len(prompts))] == [r.token_ids for r in plain]


def test_preempted_seeded_sampled_rows_keep_their_tokens():
    """Counter-based noise is a function of the seed and the output position, so a resumed row draws what it
    would have drawn: the same tokens as the uninterrupted run."""
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    params = [SamplingParams(max_new_tokens=30, temperature=1.0, seed=11 + i) for i in range(len(PROMPTS))]
    uninterrupted = engine.generate(PROMPTS, params)
    outputs, _ = run_with_preemption(engine, PROMPTS, params)
    assert [outputs[i] for i in range(len(PROMPTS))] == [r.token_ids for r in uninterrupted]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_mode_recomputes_the_cache_bit_for_bit(dtype):
    """What makes the exact-mode output hold: after resume, the row's target K/V at every committed position is
    the very one it held before it was preempted."""
    import torch

    model = _target(getattr(torch, dtype))
    engine = SpecEngine(model, make_drafter(model, block_size=8, dtype=getattr(torch, dtype)), exact=True)
    prompt = _prompts(1, seed=5)[0]
    batch = engine.open_batch()
    engine.add(batch, [prompt], SamplingParams(max_new_tokens=60))
    while batch.rows[0].n_cached < len(prompt) + 20:
        engine.step(batch)
    held = batch.rows[0].n_cached
    before = [t.clone() for t in cache_row(batch.kv.kv, 0, held)]
    engine.resume(batch, [engine.preempt(batch, 0)])
    after = cache_row(batch.kv.kv, 0, held)
    assert len(after) == len(before) > 0 and all(torch.equal(a, b) for a, b in zip(after, before))
