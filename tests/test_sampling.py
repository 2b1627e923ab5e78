"""Sampling losslessness: committed tokens follow the target's own sampling distribution.

A tiny-vocabulary target lets us enumerate the exact joint distribution of the first three generated tokens
(temperature, top-k and top-p applied as the target's sampler applies them). The engine's empirical distribution
over 12,000 seeded generations must pass a chi-square goodness-of-fit test at p > 0.001 and be within total
variation no larger than 1.5x that of an exact sample of the same size plus 0.01, with one-hot drafts (DFlash's argmax), with soft drafts (residual path), and for plain decoding.
Beyond the third token (later cycles, where the drafter's context and the caches have been rolled forward), 2,000
of the generations run to 10 tokens and every position is checked on its own: the tokens seen at position j must
fit the target's exact distribution given each sample's own prefix (expected counts = the sum over samples of
p(. | prompt + sample[:j]), computed by one full forward of the target), chi-square with a Bonferroni threshold.
A deliberately broken verifier (accept every draft), and one that is broken only from the second cycle on, must
fail these tests, so they have power.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

import flashdraft.engine.generate as engine_module
from flashdraft import DFlashDraftModel, SamplingParams, SpecEngine, make_draft_config
from flashdraft.engine import EngineConfig, NoRowState, Verdict, target_probs, verify
from flashdraft.engine.policy import AdaptiveWidth

VOCAB, MASK, N_TOKENS, N_SAMPLES = 8, 7, 3, 12000
N_LONG, N_LONG_SAMPLES = 10, 2000  # per-position checks: this many tokens for the first this many generations
PROMPT = [1, 2, 3, 4]
P_MIN = 1e-3


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = Qwen3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # peakier than uniform, still with several likely tokens
    return model


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(5)
    return DFlashDraftModel(make_draft_config(target.config, num_layers=1, block_size=4, mask_token_id=MASK)).double().eval()


def conditional_probs(model, params, sequences):
    """[n, len, VOCAB]: the target's sampling distribution for token j of each sequence given the prompt and the
    sequence's tokens before j (one causal forward over prompt + sequence)."""
    x = torch.tensor([PROMPT + list(s) for s in sequences])
    with torch.no_grad():
        logits = model(x).logits[:, len(PROMPT) - 1:-1]
    return target_probs(logits, params.temperature, params.top_p, params.top_k, params.min_p).double()


def exact_distribution(model, params):
    seqs = list(itertools.product(range(VOCAB), repeat=N_TOKENS))
    probs = conditional_probs(model, params, seqs)
    joint = probs.gather(-1, torch.tensor(seqs)[..., None])[..., 0].prod(-1)
    return dict(zip(seqs, joint.tolist()))


def empirical(engine, params, n=N_SAMPLES, batch=2000, n_long=0):
    """Counts of the first N_TOKENS tokens over n seeded generations, and the full N_LONG-token outputs of the
    first n_long of them (which run to N_LONG tokens; their first N_TOKENS count like the others')."""
    counts, long = {}, []
    for start in range(0, n, batch):
        tokens = N_LONG if start < n_long else N_TOKENS
        ps = [SamplingParams(max_new_tokens=tokens, temperature=params.temperature, top_p=params.top_p,
                             top_k=params.top_k, min_p=params.min_p, seed=start + i) for i in range(batch)]
        for res in engine.generate([PROMPT] * batch, ps):
            assert len(res.token_ids) == tokens
            key = tuple(res.token_ids[:N_TOKENS])
            counts[key] = counts.get(key, 0) + 1
            if tokens == N_LONG:
                long.append(res.token_ids)
    return counts, long


def per_position_pvalues(model, params, samples):
    """Chi-square p-value of each position j: observed token counts at j against the sum over samples of the
    target's exact distribution given that sample's own prefix (bins with expected count < 5 pooled)."""
    probs = conditional_probs(model, params, samples)
    tokens = torch.tensor(samples)
    pvalues = []
    for j in range(tokens.shape[1]):
        observed = torch.bincount(tokens[:, j], minlength=VOCAB).double()
        expected = probs[:, j].sum(0)
        big = expected >= 5
        obs, exp = observed[big].tolist(), expected[big].tolist()
        rest_o, rest_e = float(observed[~big].sum()), float(expected[~big].sum())
        if rest_e > 0:
            obs.append(rest_o)
            exp.append(rest_e)
        elif rest_o > 0:  # a token the target cannot sample at all
            pvalues.append(0.0)
            continue
        exp = [e * sum(obs) / sum(exp) for e in exp]
        pvalues.append(float(chisquare(obs, exp).pvalue))
    return pvalues


def fit(exact, counts):
    """Chi-square p-value (bins with expected count < 5 pooled) and total variation distance."""
    n = sum(counts.values())
    obs, exp, pooled_o, pooled_e = [], [], 0.0, 0.0
    for key, p in exact.items():
        if p * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
        else:
            pooled_o += counts.get(key, 0)
            pooled_e += p * n
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue, total_variation(exact, counts)


def total_variation(exact, counts):
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())


def null_total_variation(exact, n):
    """TV distance of n samples drawn from the exact distribution itself: the noise floor for n samples."""
    keys = list(exact)
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    draws = torch.multinomial(probs / probs.sum(), n, replacement=True, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=len(keys)).tolist()
    return total_variation(exact, dict(zip(keys, counts)))


class SoftProposer:
    """Drafts sampled from a fixed random distribution q, returned with q: exercises the residual p - q path."""

    needs_features = needs_histories = False

    def __init__(self):
        self.gen = torch.Generator().manual_seed(11)
        self.q = torch.softmax(torch.randn(VOCAB, generator=self.gen, dtype=torch.float64) * 2, dim=-1)

    def new_batch_state(self, buckets=None, page_size=None, max_pages=None):
        return NoRowState()

    def propose(self, state, inp, block_size):
        b, k = inp.bonus.shape[0], block_size - 1
        drafts = torch.multinomial(self.q, b * k, replacement=True, generator=self.gen).view(b, k)
        return drafts, self.q.expand(b, k, VOCAB).clone()


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.3),
]


# the default sampler (counter-based noise shared by drafter and target) and rejection sampling
# "dflash" runs the default (adaptive) draft policy; "-mixed" forces rows of one batch to different widths every
# cycle (one-token steps among them: a ragged verify); "-fixed" verifies the whole block every cycle
# "-splice1": the chain continued by prompt lookup from a 1-token match on (`lookup.py`; the default engine splices
# from 4-token matches, rare in 10 tokens), so that most drafting cycles splice
# "-steps1": every row held at one-token steps that verify the whole prompt-lookup continuation of a 1-token match
# "-trim": every row drafts the block, then verifies a prefix of it chosen from the drafter's confidence in its drafts
# (the engine's confidence trim path, with a deterministic rule in place of the priced one)
# (`lookup_steps`), so nearly every step verifies copied tokens, one-hot, through the same verifier
CASES = [("dflash", 0), ("dflash-mixed", 1), ("dflash-fixed", 2), ("dflash-generic-path-mixed", 2), ("soft", 0),
         ("soft-mixed", 1), ("ar", 2), ("dflash-rejection", 0), ("dflash-mixed-rejection", 2),
         ("soft-mixed-rejection", 1), ("ar-rejection", 0), ("dflash-splice1", 0), ("dflash-splice1-rejection", 0),
         ("dflash-steps1", 1), ("dflash-steps1-rejection", 2), ("dflash-trim", 1), ("dflash-trim-rejection", 2),
         ("dflash-mixed", 3), ("dflash-rejection", 3)]


class MixedWidths:
    """Row i of cycle c verifies WIDTHS[(c + i) % 5] tokens (capped at the block)."""

    WIDTHS = (4, 1, 2, 3, 1)

    def __init__(self, block_size: int):
        self.block_size, self.cycle = block_size, 0

    def new_row(self, sampled=False):
        return None

    def widths(self, rows, pending=None):
        self.cycle += 1
        return [min(self.block_size, self.WIDTHS[(self.cycle + i) % 5]) for i in range(len(rows))]

    def observe(self, rows, widths, accepted, timing):
        pass


class TrimByConfidence(MixedWidths):
    """Every row drafts the block; after the draft row i verifies 1 + (the number of its drafts whose confidence is
    above 0.2 + 0.15 x (cycle + i) % 4), capped at the block: prefixes of every length, from the real confidences."""

    trimmed = 0

    def widths(self, rows, pending=None):
        self.cycle += 1
        return [self.block_size] * len(rows)

    def trim(self, rows, widths, confidence, drafted_tokens):
        out = list(widths)
        for i, conf in confidence.items():
            out[i] = min(widths[i], 1 + int((conf > 0.2 + 0.15 * ((self.cycle + i) % 4)).sum()))
            TrimByConfidence.trimmed += out[i] < widths[i]
        return out


class LookupEveryStep(AdaptiveWidth):
    """One-token steps only, each verifying the whole lookup continuation found (no pricing)."""

    def widths(self, rows, pending=None):
        return [1] * len(rows)

    def worth_looking_up(self, rows, widths):
        return [True] * len(rows)

    def lookup_widths(self, rows, lengths, widths):
        return list(lengths)


def count_lookup_steps(engine):
    """A counter of the engine's one-token steps that verified a lookup continuation, from now on."""
    count, lookup_copies = [0], engine._lookup_copies

    def counting(batch, widths):
        copies, searched = lookup_copies(batch, widths)
        count[0] += len(copies)
        return copies, searched
    engine._lookup_copies = counting
    return lambda: count[0]


def count_splices(engine):
    """A counter of the engine's spliced chains from now on (read through the returned callable)."""
    count, splice_lookups = [0], engine._splice_lookups

    def counting(rows, drafting, block):
        continued = splice_lookups(rows, drafting, block)
        count[0] += len(continued)
        return continued
    engine._splice_lookups = counting
    return lambda: count[0]


@pytest.mark.parametrize("method,setting", CASES, ids=[f"{m}-{['t1', 't0.8-topk5', 't1-topp0.7', 't1-minp0.3'][i]}" for m, i in CASES])
def test_sampling_matches_target_distribution(target, drafter, method, setting, monkeypatch):
    params = SETTINGS[setting]
    sampler = "rejection" if method.endswith("-rejection") else "gumbel"
    if "-mixed" in method:
        monkeypatch.setattr(engine_module, "new_policy", lambda name, block_size, *a, **k: MixedWidths(block_size))
    if "-trim" in method:
        monkeypatch.setattr(engine_module, "new_policy", lambda name, block_size, *a, **k: TrimByConfidence(block_size))
        TrimByConfidence.trimmed = 0
    if "-steps1" in method:
        monkeypatch.setattr(engine_module, "new_policy", lambda name, block_size, costs, ragged, priors, *a, **k:
                            LookupEveryStep(block_size, costs, ragged, priors))
    if method.startswith("dflash"):
        engine = SpecEngine(target, drafter, fast_path=False if "generic" in method else None, sampler=sampler,
                            draft_policy="fixed" if "-fixed" in method else "adaptive",
                            lookup_splice=1 if "-splice1" in method else EngineConfig.lookup_splice,
                            lookup_steps=1 if "-steps1" in method else EngineConfig.lookup_steps)
    elif method.startswith("soft"):
        engine = SpecEngine(target, block_size=3, proposer=SoftProposer(), sampler=sampler)
    else:
        engine = SpecEngine(target, sampler=sampler)
    exact = exact_distribution(target, params)
    splices = count_splices(engine) if "-splice1" in method else None
    lookups = count_lookup_steps(engine) if "-steps1" in method else None
    counts, long = empirical(engine, params, n_long=N_LONG_SAMPLES)
    if splices is not None:
        assert splices() > 100, f"{method}: only {splices()} cycles spliced"  # the path under test ran
    if lookups is not None:
        assert lookups() > 1000, f"{method}: only {lookups()} lookup steps"
    if "-trim" in method:
        assert engine.confidence_trim and TrimByConfidence.trimmed > 1000, f"{method}: {TrimByConfidence.trimmed} trims"
    p_value, tv = fit(exact, counts)
    tv_floor = null_total_variation(exact, N_SAMPLES)
    assert p_value > P_MIN and tv < 1.5 * tv_floor + 0.01, (
        f"{method} {params}: chi-square p={p_value:.2e}, TV={tv:.4f} (exact-sample TV {tv_floor:.4f})"
    )
    assert len(long) == N_LONG_SAMPLES
    pvalues = per_position_pvalues(target, params, long)
    assert min(pvalues) > P_MIN / N_LONG, f"{method} {params}: per-position p-values {[f'{p:.1e}' for p in pvalues]}"


def test_broken_verifier_is_detected(target, drafter, monkeypatch):
    """Accepting every draft is not lossless; the statistical test must catch it."""

    def accept_all(target_logits, draft_tokens, params, generators=None, draft_probs=None, noise=None):
        verdict = verify(target_logits, draft_tokens, params, generators, draft_probs, noise)
        k = draft_tokens.shape[1]
        return Verdict(torch.full_like(verdict.num_accepted, k), verdict.next_tokens)

    monkeypatch.setattr(engine_module, "verify", accept_all)
    params = SETTINGS[0]
    engine = SpecEngine(target, drafter, draft_policy="fixed")  # every cycle drafts: power independent of timing
    counts, long = empirical(engine, params, n=4000, n_long=N_LONG_SAMPLES)
    p_value, tv = fit(exact_distribution(target, params), counts)
    assert p_value < P_MIN, f"broken verifier passed: p={p_value:.2e}, TV={tv:.4f}"
    assert min(per_position_pvalues(target, params, long)) < P_MIN / N_LONG


def test_verifier_broken_after_the_first_cycle_is_detected_per_position(target, drafter, monkeypatch):
    """A verifier that is right in the first cycle and accepts every draft afterwards: the per-position check
    must flag the positions the later cycles commit."""
    calls = []

    def accept_all_later(target_logits, draft_tokens, params, generators=None, draft_probs=None, noise=None):
        verdict = verify(target_logits, draft_tokens, params, generators, draft_probs, noise)
        calls.append(None)
        if len(calls) == 1:
            return verdict
        return Verdict(torch.full_like(verdict.num_accepted, draft_tokens.shape[1]), verdict.next_tokens)

    monkeypatch.setattr(engine_module, "verify", accept_all_later)
    params = SETTINGS[0]
    engine = SpecEngine(target, drafter, draft_policy="fixed")  # every cycle drafts: power independent of timing
    _, long = empirical(engine, params, n=N_LONG_SAMPLES, n_long=N_LONG_SAMPLES)
    assert len(calls) > 1
    pvalues = per_position_pvalues(target, params, long)
    assert min(pvalues[N_TOKENS:]) < P_MIN / N_LONG, pvalues


def _warped(logits, temperature, top_k, top_p):
    """transformers' distribution: its temperature, top-k and top-p warpers, then a softmax."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.9, 4, 0.8)])
def test_target_probs_match_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    assert torch.allclose(target_probs(logits, temperature, top_p, top_k), _warped(logits, temperature, top_k, top_p),
                          atol=1e-6)


# (3.0, 0, 0.95): top-p's prefix reaches past the 1,024 most probable tokens it looks among first; (0.1, 0, 0.9): most
# probabilities underflow to 0
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 40, 1.0), (1.3, 200, 0.6), (3.0, 0, 0.95),
                                                     (0.1, 0, 0.9)])
def test_target_probs_over_a_wide_vocabulary_match_transformers_warpers(temperature, top_k, top_p):
    """A verify's rows [16, 8192]: top-k's k-th value, top-p's sort and the masks run through numpy on CPU
    (`argmax.py`); the distribution is still transformers'."""
    torch.manual_seed(1)
    logits = torch.randn(16, 8192) * 3
    torch.testing.assert_close(target_probs(logits, temperature, top_p, top_k), _warped(logits, temperature, top_k,
                                                                                         top_p), rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_ps", [(0.9, 0.95, 0.5, 0.99, 0.8, 0.7), (0.9, 1.0, 0.5, 1.0, 0.8, 0.7)])
def test_target_probs_take_each_rows_own_parameters(top_ps):
    """Rows of several requests go through `target_probs` at once, each with its own temperature, top-k and top-p
    (all rows filtered by top-p, or some): each row's distribution is transformers' for its own parameters, and
    bit for bit the one it gets alone."""
    torch.manual_seed(2)
    logits = torch.randn(6, 4, 8192) * 3
    temperatures, top_ks = (1.0, 3.0, 0.7, 0.1, 1.3, 1.0), (0, 0, 40, 0, 200, 40)
    together = target_probs(logits, temperatures, top_ps, top_ks)
    for row, (temperature, top_k, top_p) in enumerate(zip(temperatures, top_ks, top_ps)):
        torch.testing.assert_close(together[row], _warped(logits[row], temperature, top_k, top_p), rtol=0, atol=1e-6)
        assert torch.equal(together[row], target_probs(logits[row], temperature, top_p, top_k))


@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.1), (0.7, 0.3), (2.0, 0.02), (1.0, 1.0)])
def test_min_p_matches_transformers_warper(temperature, min_p):
    """min-p alone: transformers' MinPLogitsWarper after its temperature (min_p 1 keeps the likeliest tokens only)."""
    torch.manual_seed(3)
    logits = torch.randn(8, 8192) * 3
    logits[0, :2] = 20.0  # a tie at the top
    scores = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    torch.testing.assert_close(target_probs(logits, temperature, min_p=min_p), torch.softmax(scores, -1), rtol=0,
                               atol=1e-6)


def test_min_p_comes_before_top_k_and_top_p_and_each_row_keeps_its_own():
    """vLLM's order: min-p on softmax(logits / T) (kept: p >= min_p x the largest p), then top-k, then top-p,
    written out here in float64; rows with and without min-p together, each as alone."""
    torch.manual_seed(4)
    logits = torch.randn(4, 3, 500) * 2
    temperatures, top_ks, top_ps, min_ps = (1.0, 0.8, 1.3, 1.0), (0, 50, 0, 10), (1.0, 0.9, 0.7, 1.0), \
        (0.05, 0.0, 0.2, 0.01)
    together = target_probs(logits, temperatures, top_ps, top_ks, min_ps)
    for row in range(4):
        scores = logits[row].double() / temperatures[row]
        p = torch.softmax(scores, -1)
        scores = scores.masked_fill(p < min_ps[row] * p.amax(-1, keepdim=True), float("-inf"))
        if top_ks[row]:
            scores = scores.masked_fill(scores < scores.topk(top_ks[row], -1).values[..., -1:], float("-inf"))
        want = torch.softmax(scores, -1)
        if top_ps[row] < 1.0:
            ordered = want.sort(-1, descending=True).values
            before = ordered.cumsum(-1) - ordered
            last = ordered.gather(-1, (before < top_ps[row]).sum(-1, keepdim=True) - 1)
            want = want.masked_fill(want < last, 0.0)
            want = want / want.sum(-1, keepdim=True)
        torch.testing.assert_close(together[row].double(), want, rtol=0, atol=1e-6)
        assert torch.equal(together[row], target_probs(logits[row], temperatures[row], top_ps[row], top_ks[row],
                                                       min_ps[row]))
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(temperature=1.0, min_p=1.5)


def test_top_p_keeps_or_drops_tied_tokens_together():
    """Top-p keeps the smallest prefix, largest first, whose mass reaches top_p, and every token as probable as
    its last one: with many tied probabilities (integer logits) the kept set is the one written out here in float64,
    whatever order a sort put the ties in."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 6, (16, 8192), generator=g).float()
    for top_p in (0.3, 0.5, 0.9):
        probs = target_probs(logits, 1.0, top_p)
        for row in range(16):
            p = torch.softmax(logits[row].double(), -1)
            values = p.sort(descending=True).values
            taken = int(((values.cumsum(0) - values) < top_p).sum())
            want = p >= values[taken - 1]
            assert torch.equal(probs[row] > 0, want)
            assert torch.allclose(probs[row].double(), torch.where(want, p, 0.0) / p[want].sum(), atol=1e-6)


def test_a_top_p_below_float32s_range_keeps_the_most_probable_token():
    """top_p = 1e-300 is valid (> 0) but rounds to 0 in float32: the prefix is the first token, not an index
    error (the server's fuzzer found it: a 500 on a schema-valid request)."""
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0], [2.0, 2.0, 0.0, 1.0]])
    probs = target_probs(logits, 1.0, 1e-300)
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(probs[1], torch.tensor([0.5, 0.5, 0.0, 0.0]))  # ties with the first are kept with it


def test_seeded_sampling_is_reproducible(target, drafter):
    engine = SpecEngine(target, drafter)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234)
    first = engine.generate([PROMPT], params)[0].token_ids
    assert engine.generate([PROMPT], params)[0].token_ids == first
