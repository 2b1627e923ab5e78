"""Draft-length policies (`flashdraft/engine/policy.py`), the cost-aware one with injected timings, and the engine
staying lossless with it."""

import pytest

from flashdraft import SamplingParams, SpecEngine
from flashdraft.engine.policy import CostAwareFallback, StepCosts
from tiny import greedy_reference, make_drafter, make_target


def _run(policy, cycles, tau, cycle_s, step_s, rows=1):
    """Feed `cycles` cycles with acceptance `tau` and the given timings; the widths the policy chose."""
    widths = []
    for _ in range(cycles):
        w = policy.block_width(16)
        widths.append(w)
        drafted = w == 16
        policy.observe(drafted, tau if drafted else 1.0, rows, cycle_s if drafted else step_s)
    return widths


def test_cost_aware_measures_a_step_then_drafts_while_drafting_pays():
    # a cycle costs 3 steps; drafts keep 5 tokens: drafting pays, so after one measuring step it keeps drafting
    widths = _run(CostAwareFallback(StepCosts()), 40, tau=5.0, cycle_s=3e-3, step_s=1e-3)
    assert widths[:3] == [16, 16, 16] and widths[3] == 1 and set(widths[4:]) == {16}


def test_cost_aware_falls_back_when_drafts_keep_less_than_a_cycle_costs():
    # drafts keep 2 tokens, a cycle costs 3 steps: fall back, probing with backoff (8, 16, ... one-token steps)
    widths = _run(CostAwareFallback(StepCosts()), 200, tau=2.0, cycle_s=3e-3, step_s=1e-3)
    assert widths.count(1) > 150 and 16 in widths[100:]  # mostly one-token steps, still probing later on
    # the same acceptance on a machine where a cycle costs 1.5 steps (a GPU, say): drafting pays
    widths = _run(CostAwareFallback(StepCosts()), 60, tau=2.0, cycle_s=1.5e-3, step_s=1e-3)
    assert widths.count(1) == 1


def test_costs_are_kept_per_row_count():
    costs = StepCosts()
    costs.record(1, True, 3e-3)
    costs.record(1, False, 1e-3)
    costs.record(8, True, 16e-3)
    assert costs.cycle_in_steps(1) == pytest.approx(3.0)
    assert costs.cycle_in_steps(7) is None  # bucket 8 has no one-token step yet
    costs.record(6, False, 4e-3)  # pooled with 8
    assert costs.cycle_in_steps(8) == pytest.approx(4.0) and costs.cycle_in_steps(5) == pytest.approx(4.0)


def test_a_new_row_count_is_measured_before_it_is_judged():
    costs = StepCosts()
    policy = CostAwareFallback(costs)
    _run(policy, 10, tau=2.0, cycle_s=1.5e-3, step_s=1e-3, rows=1)  # measured at 1 row: drafting pays there
    widths = _run(policy, 3, tau=2.0, cycle_s=12e-3, step_s=2e-3, rows=8)  # 8 rows: a cycle costs 6 steps
    assert widths[:2] == [16, 1] and costs.cycle_in_steps(8) == pytest.approx(6.0)
    assert _run(policy, 20, tau=2.0, cycle_s=12e-3, step_s=2e-3, rows=8).count(1) > 10  # then it falls back


@pytest.mark.parametrize("arch,temperature", [("qwen3", 0.0), ("qwen3", 1.0), ("phi3", 0.0), ("phi3", 1.0)])
def test_auto_policy_keeps_the_output(arch, temperature):
    target = make_target(arch)
    engine = SpecEngine(target, make_drafter(target, block_size=4), min_tau="auto")
    prompts = [[3, 4, 5, 6], [10, 11], [20, 21, 22]]
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=5)
    results = engine.generate(prompts, params)
    if temperature == 0:
        assert [r.token_ids for r in results] == [greedy_reference(target, p, 40) for p in prompts]
    else:
        assert [r.token_ids for r in results] == [r.token_ids for r in SpecEngine(target).generate(prompts, params)]
    assert sum(r.stats.plain_steps for r in results) >= 1  # it measured a one-token step at least


def test_auto_refuses_rejection_sampling():
    target = make_target("qwen3")
    with pytest.raises(ValueError, match="auto"):
        SpecEngine(target, make_drafter(target, block_size=4), min_tau="auto", sampler="rejection")
