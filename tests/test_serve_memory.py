"""Admission by a KV-cache memory budget (`--kv-cache-memory`): rows wait while the batch's paged caches, grown by a
page per row, would exceed the budget; rows that outgrow it are preempted and recomputed; outputs stay the target's own
greedy ones and the caches never exceed the budget; a request that cannot fit alone is a clear 400 (chat requests
without max_tokens may need the whole context), and the server logs the projection's figure at start-up."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import MAX_LEN, MODEL, live, make_engine, pair  # noqa: E402,F401  (fixture)
from tiny import greedy_reference, make_drafter, make_target  # noqa: E402

from flashdraft.engine import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.memory import (batch_kv_bytes, engine_bytes_per_position, memory_budget_arg,  # noqa: E402
                               resolve_memory_budget)
from flashdraft.serve.app import ServeConfig, create_app  # noqa: E402
from flashdraft.serve.metrics import Metrics  # noqa: E402
from flashdraft.serve.scheduler import Failure, Scheduler, TooLarge  # noqa: E402


def _record_rows(engine: SpecEngine) -> list[int]:
    """Rows in the batch after every step (the engine's own count, not the scheduler's)."""
    seen: list[int] = []
    step = engine.step

    def recording(batch, *joining, **named):
        out = step(batch, *joining, **named)
        seen.append(len(batch.rows))
        return out

    engine.step = recording
    return seen


def test_budget_bounds_the_batch_and_outputs_stay_the_targets():
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    prompts = {f"r{i}": [(7 * i + j) % 90 for j in range(3 + i)] for i in range(6)}
    expected = {rid: greedy_reference(target, p, 10) for rid, p in prompts.items()}
    # a page of 64 per row (8 + 10 tokens + a block fit one) + the trash page, and an eighth for pool growth:
    # two rows take 216 positions, three 288
    sched = Scheduler(engine, max_batch_size=8, max_queue=16, kv_cache_positions=250)
    rows = _record_rows(engine)
    sched.start()

    async def main():
        reqs = [sched.submit(p, SamplingParams(max_new_tokens=10), rid) for rid, p in prompts.items()]
        return await asyncio.gather(*(_collect(r) for r in reqs))

    try:
        outcomes = asyncio.run(main())
        # one that cannot fit even alone is refused at once, naming its reservation and the budget
        with pytest.raises(TooLarge, match=r"640 positions .*in pages of 64.* budget of 250 positions.*lower max"):
            sched.submit([1] * 200, SamplingParams(max_new_tokens=400), "big", loop=asyncio.new_event_loop())
    finally:
        sched.stop()
    for rid, tokens in zip(prompts, outcomes):
        assert tokens == expected[rid], rid
    assert max(rows) == 2, rows  # 8 batch slots, but the budget holds two rows' caches: the others waited


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_rows_that_outgrow_the_budget_are_preempted_and_recomputed(arch):
    """Pages of 16 here; the budget holds four rows as they start but only two at their end, so
    running rows outgrow it as they advance: the latest arrivals are preempted, resume later, and every output is
    still the target's greedy one. The engine's caches never take more than the budget (Gemma 3, whose sliding
    layers give pages back, runs more rows in it: its pools, the drafter's among them, share the budget)."""
    target = make_target(arch)
    engine = SpecEngine(target, make_drafter(target, block_size=4), kv_page_size=16, draft_policy="fixed")
    target_bytes, drafter_bytes = engine_bytes_per_position(engine)
    prompts = {f"r{i}": [(5 * i + j) % 90 for j in range(4 + 3 * i)] for i in range(6)}
    expected = {rid: greedy_reference(target, p, 60) for rid, p in prompts.items()}
    # each row's tokens + a block in pages of 16, + the trash page, + an eighth: four rows at the start with a
    # page of growth each take 180 (five 234), two at their end 198 (three 288)
    budget = 220
    metrics = Metrics("tiny")
    sched = Scheduler(engine, max_batch_size=6, max_queue=6, kv_cache_positions=budget, metrics=metrics)
    held, rows = [], []
    step = engine.step

    def recording(batch, *joining, **named):  # after the step: rows joining ride its cycle
        out = step(batch, *joining, **named)
        rows.append(len(batch.rows))
        held.append(batch_kv_bytes(batch))
        return out

    engine.step = recording
    for rid, tokens in zip(prompts, _serve_queued(sched, prompts, 60)):
        assert tokens == expected[rid], rid
    preempted = metrics.preemptions._value.get()
    assert preempted >= 1 and max(rows) >= 4, (preempted, rows)  # short rows joined; growing, some had to leave
    assert max(held) <= budget * (target_bytes + drafter_bytes), (max(held), budget)


def test_priority_scheduling_preempts_the_least_urgent_request():
    """Under `policy="priority"` the request preempted is the least urgent running one (highest priority value, then
    latest arrival), not the latest arrival; here the earliest arrivals are the least urgent (and join last: the
    queue is in priority order). Outputs stay the target's greedy ones."""
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4), kv_page_size=16, draft_policy="fixed")
    prompts = {f"r{i}": [(5 * i + j) % 90 for j in range(4 + 3 * i)] for i in range(6)}
    expected = {rid: greedy_reference(target, p, 60) for rid, p in prompts.items()}
    sched = Scheduler(engine, max_batch_size=6, max_queue=6, kv_cache_positions=220, policy="priority")
    victims, preempt = [], engine.preempt

    def recording(batch, rid):  # scheduler thread: the running requests are those of `sched._running`
        running = [sched._running[row.index] for row in batch.rows if row.index in sched._running]
        victims.append((rid, max(running, key=lambda r: (r.priority, r.arrival)).rid,
                        max(running, key=lambda r: r.arrival).rid))
        return preempt(batch, rid)

    engine.preempt = recording
    for rid, tokens in zip(prompts, _serve_queued(sched, prompts, 60, priority=lambda i: 10 - i)):
        assert tokens == expected[rid], rid
    assert victims and all(got == least for got, least, _ in victims), victims
    assert any(least != latest for _, least, latest in victims), victims  # where fcfs would take another


def test_queue_bound_still_answers_429_with_a_budget():
    from flashdraft.serve.scheduler import QueueFull

    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4), kv_page_size=16)
    sched = Scheduler(engine, max_batch_size=1, max_queue=2, kv_cache_positions=100)
    gate = threading.Event()
    step = engine.step
    engine.step = lambda batch, *joining, **named: (gate.wait(30), step(batch, *joining, **named))[1]
    sched.start()
    loop = asyncio.new_event_loop()
    try:
        for i in range(3):  # one runs, two wait
            sched.submit([1 + i, 2, 3], SamplingParams(max_new_tokens=8), f"q{i}", loop=loop)
            while i == 0 and sched.num_running == 0:
                time.sleep(0.01)
        with pytest.raises(QueueFull):
            sched.submit([4, 5], SamplingParams(max_new_tokens=8), "over", loop=loop)
    finally:
        gate.set()
        sched.stop(drain_timeout=30)
        loop.close()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_admission_figure_is_what_the_engine_allocates(arch):
    """The scheduler's figures (flashdraft.memory) against the pages the engine really holds, as rows of different
    lengths join, grow and leave: the pages rows own are each row's own tokens and next block (never the longest
    row's; Gemma 3's sliding layers, windows of 16, only what their window reaches, the rule's `kv_shares`), and the
    pools never exceed the largest batch's figure so far by more than their growth of an eighth."""
    from types import SimpleNamespace

    target = make_target(arch)
    engine = SpecEngine(target, make_drafter(target, block_size=4), kv_page_size=16, draft_policy="fixed")
    target_bytes, drafter_bytes = engine_bytes_per_position(engine)
    per_position = target_bytes + drafter_bytes
    sched = Scheduler(engine)  # not started: its rule only
    batch = engine.open_batch()
    requests = [SimpleNamespace(prompt=[1 + i] * n, params=SamplingParams(max_new_tokens=m))
                for i, (n, m) in enumerate([(10, 20), (30, 100), (5, 10), (200, 60)])]
    sizes, peak = set(), 0
    for step in range(400):
        if step % 4 == 0 and step // 4 < len(requests):
            req = requests[step // 4]  # its prefill holds its whole prompt, windowed layers too
            peak = max(peak, sched.positions([r.n_cached for r in batch.rows], [len(req.prompt)]) * per_position)
            engine.add(batch, [req.prompt], req.params, request_ids=[step // 4])
        if not batch.rows:
            break
        cycle_start = {r.index: r.n_cached for r in batch.rows}
        engine.step(batch)
        if not batch.rows:
            continue
        tokens = [cycle_start[r.index] for r in batch.rows]  # what the cycle's pages were taken for (`Batch.grow`)
        held = sched.positions(tokens) * per_position
        owned = batch_kv_bytes(batch, held_only=True)
        assert held - len(tokens) * 16 * per_position <= owned <= held, (step, owned, held)
        peak = max(peak, held)
        # without a budget a pool out of pages grows by an eighth of itself (rounded down, at least what is missing)
        assert batch_kv_bytes(batch) <= peak * 9 / 8, (step, batch_kv_bytes(batch), peak)
        sizes.add((len(tokens), owned))
    assert not batch.rows and len(sizes) >= 8  # rows joined, grew and left, the long one (260 tokens) among them
    assert batch_kv_bytes(batch) == 0  # an emptied batch lets its caches go


def _serve_queued(sched: Scheduler, prompts: dict[str, list[int]], max_new: int, priority=lambda i: 0):
    """Start `sched`, queue every prompt before it admits any (the same batches every run), serve them all and stop
    it; each request's tokens, in the order of `prompts`."""
    sched.start()

    async def main():
        with sched._cond:
            reqs = [sched.submit(p, SamplingParams(max_new_tokens=max_new), rid, priority=priority(i))
                    for i, (rid, p) in enumerate(prompts.items())]
        return await asyncio.gather(*(_collect(r) for r in reqs))

    try:
        return asyncio.run(main())
    finally:
        sched.stop()


async def _collect(req) -> list[int]:
    tokens = []
    while True:
        item = await req.queue.get()
        assert not isinstance(item, Failure), item.message
        tokens += item.token_ids
        if item.finished:
            return tokens


def test_server_budget_chat_default_max_tokens_is_a_400_and_setting_it_fits(pair, caplog):  # noqa: F811
    engine = make_engine(pair)
    target_bytes, drafter_bytes = engine_bytes_per_position(engine)
    assert target_bytes > 0 and drafter_bytes > 0
    budget = 300 * (target_bytes + drafter_bytes)  # a row of a few pages fits; a whole-context row (448) does not
    with caplog.at_level(logging.INFO, logger="flashdraft.serve"):
        app = create_app(engine, ServeConfig(model_name=MODEL, max_model_len=MAX_LEN, kv_cache_bytes=budget))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert f"a row of {MAX_LEN} tokens (prompt + max_tokens) holds up to 448 positions" in line
    assert "holds 300 positions = 0 such rows" in line
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "temperature": 0}
    with live(app) as s:
        resp = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "kv_cache_budget" and "lower max_tokens" in err["message"]
        ok = httpx.post(f"{s.url}/v1/chat/completions", json=dict(chat, max_tokens=16), timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] >= 1
        assert s.metric("kv_cache_budget_positions") == 300
        assert s.metric("requests_rejected_total", reason="kv_cache_budget") == 1
        assert s.wait_idle()["running"] == 0 and s.metric("kv_cache_reserved_positions") == 0


def test_kv_cache_memory_flag_values(capsys):
    import argparse

    import torch

    from flashdraft.serve.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--kv-cache-memory", "90%"]).kv_cache_memory == ("percent", 90.0)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--kv-cache-memory", "lots"])
    assert exit_info.value.code == 2 and "--kv-cache-memory" in capsys.readouterr().err

    assert memory_budget_arg("24") == ("GiB", 24.0) and memory_budget_arg("1.5GiB") == ("GiB", 1.5)
    assert memory_budget_arg("90%") == ("percent", 90.0)
    for bad in ("0", "-1", "abc", "150%", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_budget_arg(bad)
    assert resolve_memory_budget(("GiB", 2.0), torch.device("cpu")) == 2 * 1024**3
    assert resolve_memory_budget(("percent", 100.0), torch.device("cpu")) > 0  # RAM less this process's RSS
    with pytest.raises(ValueError, match="leaves nothing"):
        resolve_memory_budget(("percent", 1e-9), torch.device("cpu"))
