"""scripts/drafter/sampling_ceiling.py: the best marginal drafter's tau at temperature > 0, computed from the target."""

import torch

from scripts.drafter.sampling_ceiling import best_drafter_tau


def _continuations(probs: torch.Tensor, seed0: int, prompt_len: int) -> torch.Tensor:
    """The tokens the target samples under each continuation's noise (what `continuation_probs` produces)."""
    from flashdraft.engine.noise import exponential_noise, race

    seeds = torch.arange(seed0, seed0 + probs.shape[0])
    return race(probs, exponential_noise(seeds, torch.full_like(seeds, prompt_len), probs.shape[1], probs.shape[2]))


def test_a_deterministic_target_is_drafted_whole():
    probs = torch.zeros(8, 15, 32)
    probs[:, torch.arange(15), torch.arange(15) + 3] = 1.0  # every continuation the same, one token per position
    taus, per_position = best_drafter_tau(_continuations(probs, 0, 5), probs, 5, 0)
    assert taus == [16.0] * 8 and per_position == [1.0] * 15


def test_continuations_that_disagree_lose_acceptance_after_the_first_position():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 15, 32, generator=gen) ** 8  # peaked, different per continuation past position 1
    probs[:, 0] = probs[0, 0]  # position 1 sees the same context in every continuation
    probs /= probs.sum(-1, keepdim=True)
    tokens = _continuations(probs, 100, 7)
    taus, per_position = best_drafter_tau(tokens, probs, 7, 100)
    assert per_position[0] == 1.0  # the marginal there is the target's own distribution
    assert per_position[1] < 0.9 and all(1.0 <= t <= 16.0 for t in taus)
    assert sum(taus) / len(taus) < 16.0
