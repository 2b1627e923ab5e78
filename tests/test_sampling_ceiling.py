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


def test_a_drafter_that_knows_its_previous_draft_follows_the_mode_the_target_sampled():
    """Two modes chosen by the first token, each then deterministic: the marginal drafter guesses the mode at the
    second position (about half of its drafts fail there); the one that knows its previous draft drafts every
    block whole, unless it may choose only among its marginal's top 1, which holds one mode's first token."""
    from flashdraft.engine.noise import exponential_noise, race

    samples, width, vocab, seed0, prompt_len = 64, 15, 64, 7, 5
    first = torch.zeros(vocab)
    first[[3, 4]] = 0.5
    seeds = torch.arange(seed0, seed0 + samples)
    mode = race(first.expand(samples, 1, vocab), exponential_noise(seeds, torch.full_like(seeds, prompt_len), 1,
                                                                   vocab))[:, 0] == 4
    probs = torch.zeros(samples, width, vocab)
    probs[:, 0] = first
    positions = torch.arange(1, width)
    probs[:, 1:].scatter_(-1, (10 + positions + 20 * mode[:, None].long())[..., None], 1.0)
    tokens = _continuations(probs, seed0, prompt_len)
    assert 0 < mode.sum() < samples and torch.equal(tokens[:, 0] == 4, mode)
    marginal, by_position = best_drafter_tau(tokens, probs, prompt_len, seed0, order=0)
    knowing, _ = best_drafter_tau(tokens, probs, prompt_len, seed0, order=1)
    top1, _ = best_drafter_tau(tokens, probs, prompt_len, seed0, order=1, top_k=1)
    top2, _ = best_drafter_tau(tokens, probs, prompt_len, seed0, order=1, top_k=2)
    assert knowing == [16.0] * samples and top2 == [16.0] * samples
    assert by_position[0] == 1.0 and 0.2 < by_position[1] < 0.8 and sum(marginal) / samples < 12
    assert set(top1) == {1.0, 16.0}  # the mode whose first token is not the one candidate is never drafted
