"""Prompt lookup continuing the drafter's chain (`engine/lookup.py`, `SpecEngine(lookup_splice=N)`): what it copies,
that it engages where the target repeats itself, and that the output stays the target's.

- `NgramIndex.continuation` against a brute-force reading of its definition on random token streams over a small
  alphabet (many repeats), fed in chunks as a row's output grows; `splice`.
- The engine on the shipped pair, out-of-domain prompts (the target loops on several): greedy output equals the
  target's own `generate(do_sample=False)` with the splice on, splices happen, and the batch accepts more drafts
  than with the drafter's chain alone (the default drafter and the shipped DFlash2 one); with a 1-token minimum
  (splices nearly every cycle) seeded temperature-1 output is plain decoding's with the same seed.
- One-token steps that verify the continuation (`lookup_steps`): with every row held at one-token steps, greedy
  output equals the target's own `generate` and needs fewer cycles than without; sampled rows take them too and
  keep plain decoding's seeded text;
  a lookup row in a width group beside drafts that carry a q is verified with a one-hot q.
- Configuration: out-of-range values raise with the option's name; the CLI flags reach the engine.

The sampling chi-square tests run with the splice (tests/test_sampling.py: the default engine, and cases with a
1-token minimum under both samplers). What this file does not cover: speed (BENCHMARKS.md).
"""

import random

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.bench.datasets import load_prompts
from flashdraft.engine import EngineConfig
from flashdraft.engine.lookup import MAX_NGRAM, RECENT, NgramIndex, splice
from flashdraft.engine.policy import AdaptiveWidth
from flashdraft.loading import DFLASH2_DRAFTER, load_drafter, load_pair

torch.set_num_threads(1)


def brute_force(tokens, n, length, min_match=0):
    """The definition: among the last RECENT earlier occurrences of the last n tokens (each leaving a token to
    continue with), the one matching the most tokens before it (up to MAX_NGRAM in all), the latest of equals;
    nothing if that match is shorter than `min_match`."""
    last = len(tokens) - 1
    if last < n:
        return []

    def ends_like_the_context(e, m):  # the m tokens ending at e are the context's last m
        return e - m + 1 >= 0 and tokens[e - m + 1:e + 1] == tokens[last - m + 1:]

    ends = [e for e in range(n - 1, last) if ends_like_the_context(e, n)][-RECENT:]
    if not ends:
        return []
    # the longest match, then the latest: max over (match length, end)
    matched = {e: max(m for m in range(n, MAX_NGRAM + 1) if ends_like_the_context(e, m)) for e in ends}
    best = max(ends, key=lambda e: (matched[e], e))
    return tokens[best + 1:best + 1 + length] if matched[best] >= min_match else []


@pytest.mark.parametrize("seed", range(6))
def test_continuation_is_its_definition_as_a_row_grows(seed):
    rng = random.Random(seed)
    n = 1 + seed % 4
    alphabet = 2 + seed % 3  # few symbols: n-grams recur, matches of every length occur
    prompt = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 30))]
    output: list[int] = []
    index = NgramIndex(n)
    checked = found = 0
    while len(output) < 200:
        output += [rng.randrange(alphabet) for _ in range(rng.randrange(1, 6))]  # a cycle commits 1-5 tokens
        index.extend(prompt, output)
        got = index.continuation(15)
        assert got == brute_force(prompt + output, n, 15)
        assert index.continuation(15, n + 2) == brute_force(prompt + output, n, 15, n + 2)
        checked, found = checked + 1, found + bool(got)
    assert index.tokens == prompt + output
    assert found > checked // 4  # the comparison covered matches, not only misses


def test_splice_takes_the_copy_only_where_it_starts_with_the_first_draft():
    assert splice([5, 6, 7, 8], [5, 9, 9]) == [5, 9, 9, 8]
    assert splice([5, 6, 7], [5, 6, 7, 8, 9]) is None  # the same drafts: nothing to splice
    assert splice([5, 6, 7], [4, 6, 7]) is None
    assert splice([5, 6, 7], []) is None
    assert splice([5, 6], [5, 1, 2, 3]) == [5, 1]


@pytest.fixture(scope="module")
def pair():
    # the drafter in bf16 on every CPU (the default picks bf16 only where the CPU multiplies it natively): the
    # acceptance figures below are then the same drafter's
    target, tokenizer, drafter = load_pair(None, None, "cpu", draft_dtype="bfloat16")
    prompts = [tokenizer.encode(p.text) for p in load_prompts("ood-code", 8)]
    return target, tokenizer, drafter, prompts


# the accepted tokens' gain asked of the splice: the shipped DFlash2 drafter's own chain already holds most of what
# the n-gram continuation adds (393 -> 404 accepted tokens here when it shipped), the default drafter's less
@pytest.mark.parametrize("drafter_name, gain", [("default", 1.1), ("dflash2", 1.0)])
def test_greedy_with_splices_is_the_targets_output_and_accepts_more(pair, drafter_name, gain):
    target, tokenizer, drafter, prompts = pair
    if drafter_name == "dflash2":
        drafter = load_drafter(DFLASH2_DRAFTER, dtype=torch.bfloat16, device="cpu")
    params = SamplingParams(max_new_tokens=64)
    runs = {}
    for minimum in (0, 4):
        engine = SpecEngine(target, drafter, tokenizer, draft_policy="fixed", lookup_splice=minimum)
        with torch.inference_mode():
            runs[minimum] = engine.generate(prompts, params)
    for p, with_splice, without in zip(prompts, runs[4], runs[0]):
        reference = target.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False)[0, len(p):].tolist()
        assert with_splice.token_ids == reference[:len(with_splice.token_ids)] == without.token_ids
    assert sum(r.stats.lookup_splices for r in runs[4]) >= 8
    assert sum(r.stats.lookup_splices for r in runs[0]) == 0
    accepted = {m: sum(r.stats.num_accepted_tokens for r in out) for m, out in runs.items()}
    assert accepted[4] > accepted[0] * gain, accepted


def test_seeded_sampling_with_splices_is_plain_decodings(pair):
    """With a 1-token minimum nearly every drafting cycle splices; under the default sampler the seeded text is
    still plain decoding's with that seed (rejection sampling draws differ with the drafts: its distribution is
    checked by the chi-square cases of tests/test_sampling.py)."""
    target, tokenizer, drafter, prompts = pair
    params = [SamplingParams(max_new_tokens=64, temperature=1.0, seed=i) for i in range(len(prompts))]
    spliced = SpecEngine(target, drafter, tokenizer, draft_policy="fixed", lookup_splice=1)
    with torch.inference_mode():
        out = spliced.generate(prompts, params)
        plain = SpecEngine(target, None, tokenizer).generate(prompts, params)
    assert sum(r.stats.lookup_splices for r in out) >= 3
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]


@pytest.mark.parametrize("value", [-1, 9, True, 2.5])
def test_out_of_range_lookup_splice_is_refused_by_name(value):
    with pytest.raises(ValueError, match="lookup_splice"):
        EngineConfig(lookup_splice=value)


def test_the_flag_reaches_the_engine():
    from flashdraft.args import engine_config
    from flashdraft.cli import build_parser

    args = build_parser().parse_args(["demo", "--lookup-splice", "0"])
    assert engine_config(args).lookup_splice == 0
    assert engine_config(build_parser().parse_args(["demo"])).lookup_splice == EngineConfig.lookup_splice
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--lookup-splice", "9"])


class StepsOnly(AdaptiveWidth):
    """The default policy with every row held at one-token steps: what is left to verify are lookup continuations,
    priced by the policy's own `lookup_widths` on the engine's measured costs."""

    def widths(self, rows, pending=None):
        self.decision = "held"
        return [1] * len(rows)


class StepsOnlySearchingEveryRow(StepsOnly):
    """`StepsOnly` whose every row is searched for a copy (the default skips rows whose estimate for a copy's first
    token is below what a verified token costs on this machine's timings: how many copies a test sees would then
    follow the machine). What a copy verifies is still `lookup_widths`' price."""

    def worth_looking_up(self, rows, widths):
        return [True] * len(rows)


class StepsOnlyVerifyingWholeCopies(StepsOnlySearchingEveryRow):
    """`StepsOnlySearchingEveryRow` that verifies every copy whole: how many copied tokens a test sees then follows
    the target's text alone, not the price the machine's timings put on a verified token (a full CI run on a busy
    machine verified 5 copies for 3 accepted tokens where a quiet run verifies more)."""

    def lookup_widths(self, rows, lengths, widths):
        return list(lengths)


def steps_only(engine: SpecEngine, policy: type[StepsOnly] = StepsOnly) -> SpecEngine:
    open_batch = engine._new_batch

    def batch_held_at_one_token_steps(**fields):
        batch = open_batch(**fields)
        batch.policy = policy(engine.block_size, engine.costs, engine.ragged, engine.acceptance_priors)
        return batch

    engine._new_batch = batch_held_at_one_token_steps
    return engine


def test_one_token_steps_verify_the_continuation_and_keep_the_targets_output(pair):
    """At batch 1 a verified token costs a small share of a step on CPU, so rows held at one-token steps verify
    what followed the earlier occurrence wherever the target repeats (the out-of-domain answers loop)."""
    target, tokenizer, drafter, prompts = pair
    params = SamplingParams(max_new_tokens=64)
    runs = {}
    for minimum in (0, 4):
        engine = steps_only(SpecEngine(target, drafter, tokenizer, lookup_steps=minimum))
        with torch.inference_mode():
            engine.warmup(1)
            runs[minimum] = [engine.generate([p], params)[0] for p in prompts]
    for p, with_lookups, without in zip(prompts, runs[4], runs[0]):
        reference = target.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False)[0, len(p):].tolist()
        assert with_lookups.token_ids == reference[:len(with_lookups.token_ids)] == without.token_ids
    stats = [r.stats for r in runs[4]]
    assert all(r.stats.lookup_steps == 0 and r.stats.num_drafts == 0 for r in runs[0])
    assert sum(s.num_drafts for s in stats) == 0 and sum(s.lookup_steps for s in stats) >= 8
    accepted = sum(s.lookup_accepted for s in stats)
    assert accepted >= 32 and accepted <= sum(s.lookup_drafts for s in stats)
    # every committed token came from a step: one per step, plus the continuations' accepted tokens
    for r in runs[4]:
        s = r.stats
        assert s.plain_steps + s.lookup_steps + s.lookup_accepted + 1 == len(r.token_ids)  # + the prefill's
    cycles = {m: sum(r.stats.plain_steps + r.stats.lookup_steps for r in out) for m, out in runs.items()}
    assert cycles[4] < 0.8 * cycles[0], cycles


def test_sampled_rows_take_lookup_steps_and_keep_plain_decodings_seeded_text(pair):
    """Under the default sampler a copied token is accepted where it is the target's own race winner, so seeded
    text stays plain decoding's with the same seed (rejection sampling: the chi-square cases `-steps1` of
    tests/test_sampling.py). At low temperature the target loops as greedily as it does at 0. Exact mode: a
    verified block and a one-token step round differently, which at T = 0.2 flipped a near-tie in 1 of 8 answers."""
    target, tokenizer, drafter, prompts = pair
    params = [SamplingParams(max_new_tokens=64, temperature=t, seed=i) for i, t in enumerate((0.2, 0.3, 0.5, 1.0) * 2)]
    engine = steps_only(SpecEngine(target, drafter, tokenizer, exact=True), StepsOnlyVerifyingWholeCopies)
    with torch.inference_mode():
        engine.warmup(1)
        out = [engine.generate([p], q)[0] for p, q in zip(prompts, params)]
        plain = SpecEngine(target, None, tokenizer, exact=True).generate(prompts, params)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert sum(r.stats.lookup_steps for r in out) >= 8 and sum(r.stats.lookup_accepted for r in out) >= 16
    for r in out:
        s = r.stats
        assert s.plain_steps + s.lookup_steps + s.lookup_accepted + 1 == len(r.token_ids)


def test_a_lookup_row_beside_drafts_with_a_q_is_verified_one_hot():
    """Rejection-sampled DFlash2 drafts carry their q; a greedy row verifying a lookup continuation of the same
    width in the same group has none, and is verified as an argmax draft is."""
    from types import SimpleNamespace

    from tiny import make_drafter, make_target

    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=8))
    vocab = target.config.vocab_size
    logits = torch.randn(2, 4, vocab, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1)
    block = torch.zeros(2, 4, dtype=torch.long)
    block[0, 1:] = torch.tensor([1, 2, 3])  # the sampled row's drafts
    block[1, 1:] = argmax[1, :3]
    block[1, 3] = (argmax[1, 2] + 1) % vocab  # the lookup row's third token is not the target's
    q = torch.zeros(1, 7, vocab)
    q[0, torch.arange(3), block[0, 1:]] = 1.0
    rows = [SimpleNamespace(params=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(1)),
            SimpleNamespace(params=SamplingParams(), generator=None)]
    groups = [(4, torch.tensor([0, 1]))]
    accepted, next_tokens = engine._verify(rows, groups, [logits], block, [0], q, None)
    assert accepted[1] == 2 and next_tokens[1] == int(argmax[1, 2])


@pytest.mark.parametrize("value", [-1, 9, True, 2.5])
def test_out_of_range_lookup_steps_is_refused_by_name(value):
    with pytest.raises(ValueError, match="lookup_steps"):
        EngineConfig(lookup_steps=value)


def test_the_lookup_steps_flag_reaches_the_engine():
    from flashdraft.args import engine_config
    from flashdraft.cli import build_parser

    assert engine_config(build_parser().parse_args(["serve", "--lookup-steps", "0"])).lookup_steps == 0
    assert engine_config(build_parser().parse_args(["bench"])).lookup_steps == EngineConfig.lookup_steps
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--lookup-steps", "9"])
