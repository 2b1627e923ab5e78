"""Drafting with a DFlash2 drafter (`model/dflash2.py`): the DFlash forward of `DFlashProposer`, then the candidate
selector's walk along the block instead of a per-position argmax.

How each position's token is picked, per row:
- greedy rows: the walk with argmax s over the candidates (scores s over the marginal's top-k; z-lab's
  `dflash_generate` at temperature 0);
- sampled rows with counter-based noise (the default "gumbel" sampler, `noise.py`): an exponential race with the
  position's noise, the one the target runs on its p; a draft is accepted exactly when both races pick the same
  token, and the committed text is plain decoding's whatever the drafts are. Which distribution races is
  `sampled_race` (default: "selector" for a selector whose candidates are the whole vocabulary, else "marginal"):
  - "marginal": softmax(logits / T) over the whole vocabulary, DFlash-1's draft (the selector is not used). For a
    top-k selector it measured best (BENCHMARKS.md, 'Sampling at temperature 1'): a flat target often samples a
    token outside the drafter's top-k, which only a race over the whole vocabulary can draft, and adding the
    marginal's winner outside the top-k to the selector's candidates measured no better (within 1 %);
  - "selector": the walk, racing on the selector's q = softmax(s / T) over its candidates. With every token a
    candidate it races over the whole vocabulary too, conditioned on the previous draft, and measured above its own
    marginal's race (BENCHMARKS.md, 'A drafter that knows its previous draft').
- sampled rows without noise (the "rejection" sampler): a sample of q, and q itself (zero outside the candidates)
  goes to the verifier as the draft distribution, so speculative rejection sampling stays exact (z-lab's sampling;
  drawing each position from its marginal independently instead ignores the chosen prefix, z-lab #169). These rows
  draw from torch's global generator, not the request's seeded one: such output is exact in distribution but not
  reproducible per seed.
- a selector whose candidates are the whole vocabulary walks among each position's `walk_candidates` (default 16)
  likeliest winners, not all V tokens: greedy and rejection-sampled rows among the marginal's top 16, racing rows
  among the top 16 of the race itself with the pair term left out (logits / T - log E). It drafts what the walk
  over every token drafts unless the pair term lifts a token from further down; either way the verifier alone
  decides the output (rejection-sampled rows hand it q over the 16, zero elsewhere). 0: every token.

Per-position confidence for a draft policy: with `confidence=True` (which the engine sets where its policy trims
verify widths by it), after each `propose` the field `last_confidence` (`DraftConfidence`) holds, per live row and
draft position, the selector's probability of the token it chose (q at the row's temperature, T = 1 for greedy
rows; 0 for a token outside the candidates) and the marginal's probability of the same token (softmax of the
drafter's logits at that temperature, computed when first read); `drafted_confidence()` gives the policy the one
of the distribution that drafted the row: the selector's for greedy rows (and sampled rows racing on it), the
marginal's for rows racing on the marginal (`scripts/dflash2/calibration.py` measures how well each predicts
acceptance).

What this module does not know about: the target's KV cache, verification and how many tokens to draft.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashdraft.engine.argmax import argmax
from flashdraft.engine.proposers import DFlashProposer, marginal, marginal_race


@dataclass
class DraftConfidence:
    """Per live row and draft position [b, k]: the probability the selector gave the drafted token, the one of the
    distribution each row drafted from (`drafted_confidence`), and, computed when first read (a softmax over the
    vocabulary the policy does not need for greedy rows), the probability the drafter's marginal gave it."""

    selector: torch.Tensor
    drafted: torch.Tensor
    marginal_of: Callable[[], torch.Tensor]

    @functools.cached_property
    def marginal(self) -> torch.Tensor:
        return self.marginal_of()


# A choice maps the selector's score rows [b, k, top_k (previous choice), top_k] and the candidates [b, k, top_k]
# to an index per row [b, k, top_k]: every position's choice for every possible previous one at once
# (`CandidateSelector.select` then follows the path); a row's choice may depend on its position, never on the path,
# and is the same each time the walk asks for it. A selector whose candidates are the whole vocabulary asks for one
# position at a time, `at`, with one previous choice (rows [b, 1, 1, V], candidates None: the vocabulary in its
# order); the choices take rows [b, n, 1, V] for positions `at` .. `at` + n - 1 alike.


def greedy_choice(scores: torch.Tensor, candidates: torch.Tensor | None, at: int = 0) -> torch.Tensor:
    return argmax(scores)  # rows over the whole vocabulary through numpy on CPU (`argmax.py`)


def race_choice(noise: torch.Tensor, inverse_temperature: torch.Tensor):
    """The winner of each row's exponential race on softmax(scores / T) with the position's noise at the
    candidates' ids (greedy rows carry noise 1 and 1/T = 1: their argmax). Over the whole vocabulary (candidates
    None) the same race in log space, argmax s / T - log E: no softmax per position, and the noise's log taken once
    per walk."""
    log_noise = None

    def choose(scores, candidates, at=0):
        nonlocal log_noise
        if candidates is None:
            if log_noise is None:
                log_noise = noise.log()
            return argmax(scores * inverse_temperature[:, None, None, None].to(scores.dtype)
                          - log_noise[:, at:at + scores.shape[1], None])
        q = torch.softmax(scores.float() * inverse_temperature[:, None, None, None], dim=-1)
        return (q / noise[:, at:at + scores.shape[1]].gather(-1, candidates)[:, :, None]).argmax(-1)

    return choose


def sample_choice(inverse_temperature: torch.Tensor, uniform: torch.Tensor | None = None):
    """A sample of softmax(scores / T) per row, by inverting its distribution function at one uniform draw per
    position (the same draw for every previous choice: the path reads one of them, so each position's token is a
    sample of q given the chosen prefix); rows with 1/T = 0 (greedy) take the argmax. `uniform` [b, k]: the draws,
    taken once per walk (the same each time a position is asked for); None draws afresh at each call."""

    def choose(scores, candidates, at=0):
        q = torch.softmax(scores.float() * inverse_temperature[:, None, None, None], dim=-1)
        cdf = q.cumsum(-1)
        draws = torch.rand(*scores.shape[:2], device=scores.device) if uniform is None else \
            uniform[:, at:at + scores.shape[1]]
        sampled = (cdf <= draws[:, :, None, None] * cdf[..., -1:]).sum(-1).clamp(max=scores.shape[-1] - 1)
        return torch.where(inverse_temperature[:, None, None] > 0, sampled, scores.argmax(-1))

    return choose


SAMPLED_RACES = ("marginal", "selector")
# a whole-vocabulary selector's walk among each position's 16 likeliest winners: greedy tau as the walk over every
# token, and its compiled draft step ~1.1x DFlash-1's instead of ~1.4x (BENCHMARKS.md, 'The walk among sixteen')
DEFAULT_WALK_CANDIDATES = 16


class DFlash2Proposer(DFlashProposer):
    """`DFlashProposer` for a DFlash2 drafter (what `DFlashProposer(drafter, ...)` builds for one)."""

    def __init__(self, drafter, target, compile: bool = False, pack_weights: bool | None = False,
                 confidence: bool = False, sampled_race: str | None = None,
                 walk_candidates: int = DEFAULT_WALK_CANDIDATES):
        if isinstance(walk_candidates, bool) or not isinstance(walk_candidates, int) or walk_candidates < 0:
            raise ValueError(f"walk_candidates must be an integer >= 0 (0: every token), not {walk_candidates!r}")
        if sampled_race is None:
            sampled_race = "selector" if drafter.candidate_selector.whole_vocabulary else "marginal"
        if sampled_race not in SAMPLED_RACES:
            raise ValueError(f"sampled_race must be one of {', '.join(SAMPLED_RACES)}, not {sampled_race!r}")
        super().__init__(drafter, target, compile=compile, pack_weights=pack_weights)
        self.confidence = confidence
        self.sampled_race = sampled_race
        self.walk_candidates = walk_candidates
        self.last_confidence: DraftConfidence | None = None

    def _draft_tokens(self, kv, features, feature_positions, feature_valid, block, positions, context_len,
                      noise=None, inverse_temperature=None, greedy_rows=None):
        """(drafts [b, k], q over the vocabulary [b, k, V] for rejection-sampled rows or None, then the selector's
        and the marginal's probability of each draft [b, k] and the drafting distribution's, or None without
        `confidence`)."""
        hidden = self._draft_hidden(kv, features, feature_positions, feature_valid, block, positions, context_len)
        logits = self.drafter.compute_logits(hidden, self.lm_head)
        if self.keep_scores and not torch.compiler.is_compiling():
            self.last_scores = logits  # the marginals (`drafted_scores`)
        sampling = noise is None and inverse_temperature is not None
        # the marginal's race over the whole vocabulary (greedy rows: their argmax, replaced by the walk's below)
        raced = marginal_race(logits, noise, inverse_temperature) \
            if noise is not None and self.sampled_race == "marginal" else None
        if raced is not None and greedy_rows is None and not self.confidence:
            return raced, None, None, None, None  # every row sampled: the walk is not needed
        if noise is not None and raced is None:
            choose = race_choice(noise, inverse_temperature)
        elif sampling:
            choose = sample_choice(inverse_temperature, torch.rand(hidden.shape[:2], device=hidden.device))
        else:
            choose = greedy_choice
        narrow_to = (self.walk_candidates or None) if self.drafter.candidate_selector.whole_vocabulary else None
        ranking = None
        if narrow_to is not None and noise is not None and raced is None:
            # racing rows: the tokens most likely to win the race, s / T - log E with the pair term left out
            ranking = logits.float() * inverse_temperature[:, None, None] - noise[:, :logits.shape[1]].log()
        walk = self.drafter.select(hidden, self.lm_head, block[:, 0], choose, with_scores=sampling or self.confidence,
                                   logits=logits, narrow_to=narrow_to, ranking=ranking)
        tokens, candidates = walk["tokens"], walk["candidates"]
        if raced is not None:
            tokens = raced if greedy_rows is None else torch.where(greedy_rows[:, None], tokens, raced)
        if not (sampling or self.confidence):
            return tokens, None, None, None, None
        # the row's temperature for sampled rows, 1 for greedy ones
        scale = torch.ones(tokens.shape[0], device=tokens.device) if inverse_temperature is None else \
            torch.where(inverse_temperature > 0, inverse_temperature, 1.0)
        q = torch.softmax(walk["scores"].float() * scale[:, None, None], dim=-1)  # [b, k, candidates]
        if not sampling:
            draft_probs = None
        elif candidates is None:  # every token a candidate, in vocabulary order
            draft_probs = q
        else:
            draft_probs = torch.zeros(*tokens.shape, logits.shape[-1], device=q.device).scatter_(-1, candidates, q)
        if not self.confidence:
            return tokens, draft_probs, None, None, None
        selector = q.gather(-1, tokens[..., None])[..., 0] if candidates is None else \
            (q * (candidates == tokens[..., None])).sum(-1)

        def marginal_of():
            return marginal(logits, scale).gather(-1, tokens[..., None])[..., 0]

        # rows that raced the marginal are judged by it, the others (greedy, the selector's race or samples) by q
        drafted = selector if raced is None else marginal_of() if greedy_rows is None else \
            torch.where(greedy_rows[:, None], selector, marginal_of())
        return tokens, draft_probs, selector, marginal_of, drafted

    def drafted_confidence(self) -> torch.Tensor | None:
        return None if self.last_confidence is None else self.last_confidence.drafted

    def _proposal(self, drafts, live: int, device):
        tokens, draft_probs, selector, marginal_of, drafted = drafts
        if self.last_scores is not None:
            self.last_scores = self.last_scores[:live].to(device)
        if drafted is not None:
            self.last_confidence = DraftConfidence(selector[:live].to(device), drafted[:live].to(device),
                                                   lambda: marginal_of()[:live].to(device))
        return tokens[:live].to(device), None if draft_probs is None else draft_probs[:live].to(device)
