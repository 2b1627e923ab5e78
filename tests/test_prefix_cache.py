"""Automatic prefix caching (`engine/prefix_cache.py`): prompts that start with pages an earlier prompt or answer
computed take the target's K/V and the drafter's features for them from the cache and compute only the rest.

Covered: the store's keys (a chain of pages, token for token; salts apart), its least-recently-used eviction (a
chain's end before its start) within its bound; a hit's K/V and pending drafter features equal to what a prefill
without the cache computes, for a shared start and for a conversation's next turn (answers' pages); greedy output
equal to the target's own `generate` for prompts sharing prefixes, added apart, riding a running batch's cycle,
admitted together, preempted and resumed, over a conversation's turns, with DFlash and plain decoding; seeded
sampling equal to plain decoding without a cache; the ride-along and prefill budgets counting only uncached tokens;
the served usage's `prompt_tokens_details.cached_tokens`, the Prometheus counters and `cache_salt`; the flags and a
percentage KV budget.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from flashdraft.engine import EngineConfig, SamplingParams, SpecEngine
from flashdraft.engine.batch import take_pending
from flashdraft.engine.prefix_cache import PrefixCache
from flashdraft.model.slots import PagedKV
from test_preemption import run_with_preemption
from tiny import cache_row, greedy_reference, make_drafter, make_target

PAGE = 4
SYSTEM = list(range(10, 40))  # 30 tokens: 7 full pages of 4 before a prompt's own tokens
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + [8], SYSTEM[:13] + [1, 2, 3], SYSTEM + [5, 6, 7, 9, 9, 9, 9, 9],
           [3, 1, 4, 1, 5, 9, 2, 6, 5]]


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


@pytest.fixture(scope="module")
def expected(target):
    return [greedy_reference(target, p, 20) for p in PROMPTS]


def engine(target, drafter=True, tokens=256, **options) -> SpecEngine:
    return SpecEngine(target, make_drafter(target, block_size=4) if drafter else None, kv_page_size=PAGE,
                      prefix_cache_tokens=tokens, draft_policy="fixed", **options)


# ---- the store -----------------------------------------------------------------------------------------------

def _filled_kv(rows: int, length: int, seed: int = 0) -> PagedKV:
    kv = PagedKV(2, rows, 2, 8, torch.float64, "cpu", PAGE, [length] * rows)
    g = torch.Generator().manual_seed(seed)
    for t in kv.keys + kv.values:
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    return kv


def test_a_hit_is_a_chain_of_whole_pages_token_for_token_and_leaves_the_last_token():
    cache = PrefixCache(PAGE, 100)
    kv = _filled_kv(1, 16)
    prompt = list(range(100, 112))  # 3 full pages
    cache.insert(kv, [0], [prompt])
    assert len(cache) == 3
    assert cache.match(prompt).tokens == 8  # the third page would leave no token to compute
    assert cache.match(prompt + [1]).tokens == 12
    assert cache.match(prompt[:4] + [0] + prompt[5:] + [1]).tokens == 4  # a page differs: the chain stops there
    assert cache.match([0] + prompt).tokens == 0  # the same tokens elsewhere are another chain
    assert cache.cached_tokens(prompt + [1]) == 12
    assert (cache.queries, cache.hits) == (12 + 13 + 13 + 13, 8 + 12 + 4)  # `cached_tokens` counts nothing


def test_loaded_pages_are_the_pages_inserted():
    cache = PrefixCache(PAGE, 100)
    source = _filled_kv(2, 12, seed=1)
    prompts = [list(range(12)), list(range(50, 62))]
    cache.insert(source, [0, 1], prompts)
    dest = _filled_kv(2, 12, seed=2)
    hits = [cache.match(p + [0]) for p in prompts[::-1]]
    cache.load(dest, [0, 1], hits)
    for row, source_row in ((0, 1), (1, 0)):
        for got, want in zip(cache_row(dest, row, 12), cache_row(source, source_row, 12)):
            assert torch.equal(got, want)


def test_the_least_recently_used_pages_leave_first_a_chains_end_before_its_start():
    cache = PrefixCache(PAGE, 4)
    kv = _filled_kv(3, 8)
    a, b, c = list(range(8)), list(range(20, 28)), list(range(40, 48))
    cache.insert(kv, [0, 1], [a, b])  # 4 pages: full
    assert cache.match(a + [0]).tokens == 8  # a is now the more recent chain
    cache.insert(kv, [2], [c])  # needs 2 pages: b's two leave, its end first
    assert len(cache) == 4
    assert cache.match(b + [0]).tokens == 0
    assert cache.match(c + [0]).tokens == 8 and cache.match(a + [0]).tokens == 8
    cache.insert(kv, [1], [b[:4]])  # one page: c's end leaves (a was touched after c), c's start stays reachable
    assert cache.match(c + [0]).tokens == 4 and cache.match(a + [0]).tokens == 8


def test_a_salt_keeps_its_prompts_pages_to_itself():
    cache = PrefixCache(PAGE, 100)
    kv = _filled_kv(2, 8)
    prompt = list(range(8))
    cache.insert(kv, [0, 1], [prompt, prompt], salts=[None, "tenant-a"])
    assert len(cache) == 4  # the same tokens under two roots
    assert cache.match(prompt + [0]).tokens == 8 and cache.match(prompt + [0], "tenant-a").tokens == 8
    assert cache.match(prompt + [0], "tenant-b").tokens == 0 and cache.cached_tokens(prompt + [0], "tenant-b") == 0


def test_the_store_grows_as_pages_come_within_its_bound():
    cache = PrefixCache(PAGE, 40)
    kv = _filled_kv(1, 200)
    cache.insert(kv, [0], [list(range(8))])
    assert cache.keys[0].shape[0] == 16  # allocated as pages come, not the bound at once
    cache.insert(kv, [0], [list(range(1000, 1200))])  # 50 pages: the bound holds 40
    assert cache.keys[0].shape[0] == 40 and len(cache) == 40
    cache.clear()
    assert len(cache) == 0 and cache.match(list(range(9))).tokens == 0


# ---- exactness ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("turn", ["prompt", "conversation"])
def test_a_hit_gives_the_rows_cache_and_drafter_context_a_prefill_computes(target, turn):
    """The target's K/V and the pending features of a prompt found in the cache equal those a prefill without the
    cache computes (float64: to rounding), so the drafter drafts from the same context: a prompt sharing another
    prompt's start, and a conversation's next turn (the first turn's prompt and answer, then more), whose answer's
    pages went in as decoding filled them."""
    warm, cold = engine(target), engine(target, tokens=0)
    first = warm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20))[0]  # the shared start goes in
    prompt = PROMPTS[3] if turn == "prompt" else PROMPTS[0] + first.token_ids + [9, 9, 9]
    params = SamplingParams(max_new_tokens=8)
    rows = []
    for eng in (warm, cold):
        batch = eng.open_batch()
        eng.add(batch, [prompt], params)
        row = batch.rows[0]
        features = take_pending([row.pending], *eng._feature_spec).values[0]
        rows.append((cache_row(batch.kv.kv, 0, len(prompt)), features, row.stats.cached_tokens))
    (kv_warm, features_warm, hit), (kv_cold, features_cold, none) = rows
    assert (hit, none) == ((32, 0) if turn == "prompt" else ((len(prompt) - 1) // PAGE * PAGE, 0))
    assert features_warm.shape == features_cold.shape == (len(prompt), features_cold.shape[-1])
    torch.testing.assert_close(features_warm, features_cold, rtol=1e-10, atol=1e-10)
    for got, want in zip(kv_warm, kv_cold):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("drafter", [True, False], ids=["dflash", "plain"])
def test_prompts_that_share_prefixes_end_with_the_targets_greedy_output(target, expected, drafter):
    eng = engine(target, drafter)
    params = SamplingParams(max_new_tokens=20)
    apart = [eng.generate([p], params)[0] for p in PROMPTS]
    assert [r.token_ids for r in apart] == expected
    assert [r.stats.cached_tokens for r in apart] == [0, 28, 12, 32, 0]
    # riding a running batch's cycle: each prompt joins the next step
    batch, outputs = eng.open_batch(), {}
    for ev in eng.add(batch, [PROMPTS[0]], params, request_ids=[0]):
        outputs.setdefault(ev.index, []).extend(ev.token_ids)
    for i, prompt in enumerate(PROMPTS[1:], 1):
        assert eng.rides_cycle(batch, [eng._make_rows([prompt], params)[0]])
        for ev in eng.step(batch, [prompt], params, request_ids=[i]):
            outputs.setdefault(ev.index, []).extend(ev.token_ids)
    while batch.rows:
        for ev in eng.step(batch):
            outputs.setdefault(ev.index, []).extend(ev.token_ids)
    assert [outputs[i] for i in range(len(PROMPTS))] == expected
    assert eng.prefix_cache.hits > 4 * 28
    # a salted request finds only its salt's pages, and stays exact
    salted = SamplingParams(max_new_tokens=20, cache_salt="tenant-a")
    first, again = (eng.generate([PROMPTS[1]], salted)[0] for _ in range(2))
    assert (first.token_ids, again.token_ids) == (expected[1], expected[1])
    assert (first.stats.cached_tokens, again.stats.cached_tokens) == (0, 28)
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_hits_in_a_sliding_window_target_end_with_its_greedy_output():
    """Gemma 2 (windows of 16 shorter than these contexts, capped scores and logits): cached pages hold every
    position, the windows are masks, so hits stay exact."""
    windowed = make_target("gemma2")
    eng = engine(windowed)
    results = [eng.generate([p], SamplingParams(max_new_tokens=20))[0] for p in PROMPTS]
    assert [r.token_ids for r in results] == [greedy_reference(windowed, p, 20) for p in PROMPTS]
    assert [r.stats.cached_tokens for r in results] == [0, 28, 12, 32, 0]


@pytest.mark.parametrize("drafter", [True, False], ids=["dflash", "plain"])
def test_a_conversations_next_turn_finds_the_answer_and_ends_with_the_targets_greedy_output(target, drafter):
    eng = engine(target, drafter)
    turn, written = PROMPTS[1], 0
    for n in range(3):
        result = eng.generate([turn], SamplingParams(max_new_tokens=13))[0]
        assert result.token_ids == greedy_reference(target, turn, 13)
        if n:  # the earlier turns' prompts and answers in full pages (an answer's last token was never computed)
            assert result.stats.cached_tokens == written // PAGE * PAGE
        written = len(turn) + len(result.token_ids) - 1
        turn = turn + result.token_ids + [7 + n, 8]


@pytest.mark.parametrize("how", ["add", "step"])
def test_requests_sharing_a_start_admitted_together_compute_it_once(target, expected, how):
    """A request's n choices, or requests with one system prompt arriving together: the first computes the shared
    pages, the others find them (prefilled after it, or joining after the cycle it rode)."""
    eng = engine(target)
    params = SamplingParams(max_new_tokens=20)
    batch, outputs, stats = eng.open_batch(), {}, {}
    group = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[3]]
    if how == "step":  # into a running batch: the first rides the cycle, the others join after it
        eng.add(batch, [[1, 2, 3]], params, request_ids=["other"])
    events = (eng.add if how == "add" else eng.step)(batch, group, params, request_ids=list(range(len(group))))
    while True:
        for ev in events:
            outputs.setdefault(ev.index, []).extend(ev.token_ids)
            if ev.finished:
                stats[ev.index] = ev.result.stats.cached_tokens
        if not batch.rows:
            break
        events = eng.step(batch)
    assert [outputs[i] for i in range(len(group))] == [expected[0], expected[0], expected[1], expected[4], expected[3]]
    assert [stats[i] for i in range(len(group))] == [0, 32, 28, 0, 32]


def test_acceptance_is_the_same_with_and_without_hits(target):
    """Fixed policy, same drafter: a hit's drafter context is the prefill's, so every cycle accepts the same."""
    params = SamplingParams(max_new_tokens=24)
    warm, cold = engine(target), engine(target, tokens=0)
    warm.generate([PROMPTS[0]], params)
    got = warm.generate(PROMPTS[1:4], params)
    want = cold.generate(PROMPTS[1:4], params)
    assert [r.stats.acceptance_lengths for r in got] == [r.stats.acceptance_lengths for r in want]
    assert all(r.stats.cached_tokens for r in got)


def test_preempted_rows_resume_through_the_cache_with_the_targets_greedy_output(target, expected):
    eng = engine(target)
    eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    outputs, preemptions = run_with_preemption(eng, PROMPTS, SamplingParams(max_new_tokens=20))
    assert [outputs[i] for i in range(len(PROMPTS))] == expected
    assert preemptions >= 4


def test_seeded_sampling_is_plain_decodings_with_the_same_seed(target):
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    plain = SpecEngine(target, None, kv_page_size=PAGE).generate(PROMPTS, params)
    eng = engine(target)
    eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    got = eng.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert sum(r.stats.cached_tokens for r in got) >= 28 * 3


def test_a_small_cache_evicts_and_stays_exact(target, expected):
    eng = engine(target, tokens=3 * PAGE)
    params = SamplingParams(max_new_tokens=20)
    for _ in range(2):
        assert [eng.generate([p], params)[0].token_ids for p in PROMPTS] == expected
        assert len(eng.prefix_cache) <= 3


# ---- when it is used -----------------------------------------------------------------------------------------------

def test_the_ride_along_rule_counts_the_tokens_left_to_compute(target):
    eng = engine(target, mixed_prefill_tokens=12)
    params = SamplingParams(max_new_tokens=30)
    batch = eng.open_batch()
    eng.add(batch, [PROMPTS[4]], params)
    joining = eng._make_rows([PROMPTS[0]], params)
    assert not eng.rides_cycle(batch, joining)  # 33 tokens to compute
    eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    assert eng.rides_cycle(batch, joining)  # 5 left after 28 cached


def test_warmup_keeps_nothing_and_exact_or_generic_engines_have_no_cache(target):
    eng = engine(target)
    eng.warmup(2)
    assert len(eng.prefix_cache) == 0 and eng.prefix_cache.queries == 0
    for options in ({"exact": True}, {"fast_path": False}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert engine(target, **options).prefix_cache is None
        assert any("prefix_cache_tokens" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        EngineConfig(prefix_cache_tokens=-1)


# ---- served ------------------------------------------------------------------------------------------------------

def test_served_usage_and_metrics_count_the_cached_prompt_tokens(tmp_path):
    """Two completions of one long prompt through the server: the second's usage says which prompt tokens the
    cache gave, both texts are the same (greedy), and /metrics counts the tokens looked up and found."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import httpx

    from flashdraft.loading import load_pair
    from flashdraft.serve.app import ServeConfig, create_app
    from test_serve import live
    from tiny import save_text_pair

    save_text_pair(tmp_path, max_positions=512)
    model, tokenizer, drafter = load_pair(tmp_path / "target", tmp_path / "drafter", "cpu", "float32")
    eng = SpecEngine(model, drafter, tokenizer, prefix_cache_tokens=1024)
    prompt = " ".join(f"def f{i}(x): return x + {i}" for i in range(40))
    n = len(tokenizer(prompt)["input_ids"])
    assert n > 128
    with live(create_app(eng, ServeConfig(model_name="tiny"))) as server:
        bodies = [httpx.post(f"{server.url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=60).json()
            for _ in range(2)]
        assert bodies[0]["choices"][0]["text"] == bodies[1]["choices"][0]["text"]
        cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
        assert cached == [0, (n - 1) // 64 * 64]
        assert server.metric("prefix_cache_queries_total") == 2 * n
        assert server.metric("prefix_cache_hits_total") == cached[1]
        salted = httpx.post(f"{server.url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "cache_salt": "tenant-a"},
            timeout=60).json()
        assert salted["choices"][0]["text"] == bodies[0]["choices"][0]["text"]
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        bad = httpx.post(f"{server.url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "cache_salt": ""}, timeout=60)
        assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]


def test_serve_flags_size_the_cache_from_its_memory(capsys, tmp_path):
    import argparse

    from flashdraft.memory import GiB, kv_bytes_per_position
    from flashdraft.serve.cli import add_serve_parser, build_engine
    from tiny import save_text_pair

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    assert args.enable_prefix_caching and args.prefix_cache_memory == ("GiB", 1.0)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--prefix-cache-memory", "0"])
    assert exit_info.value.code == 2 and "--prefix-cache-memory" in capsys.readouterr().err

    save_text_pair(tmp_path, max_positions=512)
    pair = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "drafter"), "--device", "cpu",
            "--dtype", "float32", "--chat-template", "{{ messages }}"]
    engine, _ = build_engine(parser.parse_args(["serve", *pair, "--prefix-cache-memory", "0.01"]))
    config = engine.target.config
    per_position = kv_bytes_per_position(config, torch.float32) + 4 * config.hidden_size * len(
        engine.drafter.target_layer_ids)
    assert engine.config.prefix_cache_tokens == int(0.01 * GiB) // per_position
    assert engine.prefix_cache.max_pages == -(-engine.config.prefix_cache_tokens // 64)
    engine, _ = build_engine(parser.parse_args(["serve", *pair, "--no-enable-prefix-caching"]))
    assert engine.prefix_cache is None


def test_the_prefill_budget_counts_only_the_tokens_left_to_compute(target):
    """`--max-prefill-tokens` admits requests by the tokens their prefill computes: prompts whose start is cached
    join together where the same prompts uncached join one per scheduler step."""
    import asyncio

    from flashdraft.serve.scheduler import Request, Scheduler

    loop = asyncio.new_event_loop()
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(50, 56)]  # 33 tokens, 32 of them in full pages
    admitted = []
    for cached in (False, True):
        eng = engine(target, tokens=64 if cached else 0)
        if cached:
            eng.generate([SYSTEM + [1, 2, 3]], SamplingParams(max_new_tokens=2))
        sched = Scheduler(eng, max_batch_size=8, max_prefill_tokens=40)
        for i, prompt in enumerate(prompts):
            sched._enqueue(Request(f"r{i}", prompt, SamplingParams(max_new_tokens=4), loop))
        sched._iteration()
        admitted.append(len(sched._running))
    loop.close()
    assert admitted == [1, 6]  # 33 + 33 > 40 tokens; 6 x (33 - 28) = 30 <= 40


def test_a_kv_budget_given_as_a_percentage_leaves_room_for_the_prefix_cache(tmp_path):
    import argparse

    from flashdraft.memory import GiB
    from flashdraft.serve.cli import add_serve_parser, build_engine, kv_cache_bytes
    from tiny import save_text_pair

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command"))
    save_text_pair(tmp_path, max_positions=512)
    pair = ["serve", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "drafter"), "--device", "cpu",
            "--dtype", "float32", "--chat-template", "{{ messages }}", "--prefix-cache-memory", "0.5"]
    args = parser.parse_args([*pair, "--kv-cache-memory", "2"])
    engine, _ = build_engine(args)
    assert kv_cache_bytes(args, engine) == 2 * GiB  # GiB: the KV caches' own, the prefix cache beside them
    args = parser.parse_args([*pair, "--kv-cache-memory", "100%"])
    uncached = SimpleNamespace(target=engine.target, prefix_cache=None)
    gap = kv_cache_bytes(args, uncached) - kv_cache_bytes(args, engine)
    assert abs(gap - GiB // 2) < 16 * 1024**2  # the store's half GiB comes out of it (RSS moves a little between)
    assert kv_cache_bytes(parser.parse_args(pair), engine) is None
