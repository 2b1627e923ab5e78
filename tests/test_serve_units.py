"""Serve pieces without HTTP: the scheduler (continuous batching over a real SpecEngine, float64 tiny models, an
oracle drafter that exercises every acceptance length), spec-decode metrics accounting, shutdown, request
validation and the CLI parser."""

from __future__ import annotations

import argparse
import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tiny import OracleProposer, greedy_reference, make_drafter, make_target  # noqa: E402

from flashdraft.engine import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.serve import protocol  # noqa: E402
from flashdraft.serve.cli import add_serve_parser, run_serve  # noqa: E402
from flashdraft.serve.metrics import Metrics  # noqa: E402
from flashdraft.serve.scheduler import Failure, Scheduler, SchedulerClosed  # noqa: E402


def _metric(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, **labels}) or 0.0


async def _collect(req) -> tuple[list[int], object]:
    tokens = []
    while True:
        item = await req.queue.get()
        if isinstance(item, Failure):
            return tokens, item
        tokens += item.token_ids
        if item.finished:
            assert tokens == item.result.token_ids
            return tokens, item.result


@pytest.mark.parametrize("oracle", [True, False])
def test_scheduler_joins_and_leaves_and_counts(oracle):
    target = make_target("qwen3")
    prompts = {f"r{i}": [(5 * i + j) % 90 for j in range(2 + 3 * i)] for i in range(10)}
    budgets = {rid: 6 + 3 * i for i, rid in enumerate(prompts)}
    expected = {rid: greedy_reference(target, p, budgets[rid]) for rid, p in prompts.items()}
    if oracle:
        engine = SpecEngine(target, block_size=5, proposer=OracleProposer(
            {rid: prompts[rid] + expected[rid] for rid in prompts}, seed=3))
    else:
        engine = SpecEngine(target, make_drafter(target, block_size=4))
    metrics = Metrics("m")
    sched = Scheduler(engine, max_batch_size=3, max_queue=16, metrics=metrics)
    sched.start()

    async def main():
        reqs = []
        for i, rid in enumerate(prompts):  # staggered arrivals: requests join a running batch
            reqs.append(sched.submit(prompts[rid], SamplingParams(max_new_tokens=budgets[rid]), rid))
            if i % 3 == 2:
                await asyncio.sleep(0.01)
        return await asyncio.gather(*(_collect(r) for r in reqs))

    try:
        outcomes = asyncio.run(main())
    finally:
        sched.stop()
    stats = []
    for rid, (tokens, result) in zip(prompts, outcomes):
        assert tokens == expected[rid], rid
        stats.append(result.stats)
    k = engine.block_size - 1
    drafts = sum(s.num_drafts for s in stats)
    assert _metric(metrics, "spec_decode_num_drafts_total") == drafts
    assert _metric(metrics, "spec_decode_num_draft_tokens_total") == sum(s.drafted_tokens for s in stats)
    assert _metric(metrics, "spec_decode_num_proposed_tokens_total") == sum(s.proposed_tokens for s in stats)
    assert all(s.drafted_tokens <= s.proposed_tokens <= k * s.num_drafts for s in stats)
    assert _metric(metrics, "spec_decode_num_one_token_steps_total") == sum(s.plain_steps for s in stats)
    assert _metric(metrics, "spec_decode_num_lookup_splices_total") == sum(s.lookup_splices for s in stats)
    assert _metric(metrics, "spec_decode_num_lookup_steps_total") == sum(s.lookup_steps for s in stats)
    assert _metric(metrics, "spec_decode_num_lookup_draft_tokens_total") == sum(s.lookup_drafts for s in stats)
    assert _metric(metrics, "spec_decode_num_lookup_accepted_tokens_total") == sum(s.lookup_accepted for s in stats)
    assert _metric(metrics, "spec_decode_num_accepted_tokens_total") == sum(s.num_accepted_tokens for s in stats)
    for pos in range(k):
        want = sum(sum(a > pos + 1 for a in s.acceptance_lengths) for s in stats)
        assert _metric(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == want
    if oracle:  # the oracle accepts long prefixes: the per-position accounting saw real acceptance
        assert _metric(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="2") > 0
    assert _metric(metrics, "generation_tokens_total") == sum(len(t) for t, _ in outcomes)
    assert _metric(metrics, "prompt_tokens_total") == sum(map(len, prompts.values()))
    assert _metric(metrics, "request_success_total", finished_reason="length") == len(prompts)
    assert _metric(metrics, "num_requests_running") == 0


def test_a_bad_request_joining_a_running_batch_is_answered_alone():
    """New requests ride the running rows' cycle; one the engine refuses (a token outside the vocabulary) gets a
    400 while the others, joining in the same iteration, finish as they would alone."""
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    good = {"a": [3, 4, 5], "b": [6, 7], "c": [8, 9, 10, 11]}
    expected = {rid: greedy_reference(target, p, 40 if rid == "a" else 8) for rid, p in good.items()}
    sched = Scheduler(engine, max_batch_size=4, max_queue=8)
    sched.start()

    async def main():
        first = sched.submit(good["a"], SamplingParams(max_new_tokens=40), "a")
        while sched.num_running == 0:
            await asyncio.sleep(0.001)
        reqs = [first] + [sched.submit(p, SamplingParams(max_new_tokens=8), rid) for rid, p in good.items()
                          if rid != "a"] + [sched.submit([1, 10 ** 6], SamplingParams(max_new_tokens=8), "bad")]
        return await asyncio.gather(*(_collect(r) for r in reqs))

    try:
        outcomes = asyncio.run(main())
    finally:
        sched.stop()
    for rid, (tokens, _) in zip(good, outcomes):
        assert tokens == expected[rid], rid
    assert isinstance(outcomes[-1][1], Failure) and outcomes[-1][1].status == 400


def test_stop_cancels_in_flight_and_refuses_new():
    target = make_target("llama")
    engine = SpecEngine(target)
    step = engine.step

    def slow_step(batch, *joining, **named):
        import time

        time.sleep(0.01)
        return step(batch, *joining, **named)

    engine.step = slow_step
    sched = Scheduler(engine, max_batch_size=1, max_queue=4)
    sched.start()

    async def main():
        reqs = [sched.submit([1, 2, 3], SamplingParams(max_new_tokens=400), f"r{i}") for i in range(3)]
        await asyncio.sleep(0.1)
        sched.cancel("r2")  # a waiting request leaves the queue at once
        assert sched.num_waiting == 1
        await asyncio.to_thread(sched.stop, 0.0)
        with pytest.raises(SchedulerClosed):
            sched.submit([1], SamplingParams(max_new_tokens=2), "late")
        return await asyncio.gather(*(_collect(r) for r in reqs[:2]))

    outcomes = asyncio.run(main())
    assert all(isinstance(res, Failure) and res.status == 503 for _, res in outcomes)
    assert not sched.alive


def test_priority_policy_serves_waiting_requests_by_priority_then_arrival():
    """One batch slot: while the first request runs, the rest queue; under "priority" they start in order of
    priority (lower first), then arrival; under "fcfs" a nonzero priority is refused."""
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    started, add = [], engine.add

    def recording(batch, prompts, params=None, request_ids=None):
        started.extend(request_ids)
        return add(batch, prompts, params, request_ids)

    engine.add = recording
    with pytest.raises(ValueError, match="priority scheduling"):
        Scheduler(engine).submit([1, 2], SamplingParams(max_new_tokens=2), "x", loop=asyncio.new_event_loop(),
                                 priority=1)
    with pytest.raises(ValueError, match="policy must be one of"):
        Scheduler(engine, policy="lifo")
    sched = Scheduler(engine, max_batch_size=1, max_queue=8, policy="priority")
    sched.start()
    order = [("first", 0), ("late", 5), ("urgent", -3), ("normal", 0), ("urgent2", -3), ("normal2", 0)]

    async def main():
        with sched._cond:  # all queued before the scheduler admits any
            reqs = [sched.submit([3, 1 + i], SamplingParams(max_new_tokens=4), rid, priority=p)
                    for i, (rid, p) in enumerate(order)]
        return await asyncio.gather(*(_collect(r) for r in reqs))

    try:
        outcomes = asyncio.run(main())
    finally:
        sched.stop()
    assert started == ["urgent", "urgent2", "first", "normal", "normal2", "late"]
    assert all(not isinstance(res, Failure) for _, res in outcomes)


def test_metrics_count_drafts_by_position():
    m = Metrics("x")
    m.count_drafts([1, 3, 5, 2], [5, 4, 5, 2], block_size=5, one_token_steps=3, lookup_splices=2)
    assert _metric(m, "spec_decode_num_drafts_total") == 4
    assert _metric(m, "spec_decode_num_lookup_splices_total") == 2
    assert _metric(m, "spec_decode_num_draft_tokens_total") == 4 + 3 + 4 + 1  # the verified drafts
    assert _metric(m, "spec_decode_num_proposed_tokens_total") == 16  # block_size - 1 per drafting cycle
    assert _metric(m, "spec_decode_num_one_token_steps_total") == 3
    assert _metric(m, "spec_decode_num_accepted_tokens_total") == 0 + 2 + 4 + 1
    got = [_metric(m, "spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(4)]
    assert got == [3, 2, 1, 1]
    assert b"spec_decode_num_accepted_tokens_per_pos_total" in m.render()
    m.count_drafts([2, 1], [2, 4], block_size=5, draft_lengths=[4, 4])  # short drafts: the widest width - 1 each
    assert _metric(m, "spec_decode_num_proposed_tokens_total") == 16 + 6
    assert _metric(m, "spec_decode_num_drafts_total") == 6


def test_protocol_messages():
    with pytest.raises(protocol.APIError, match="'temperature' must be a number"):
        protocol.parse_body(b'{"model": "m", "prompt": "x", "temperature": "1"}', protocol.CompletionRequest)
    with pytest.raises(protocol.APIError, match="missing required parameter 'messages'"):
        protocol.parse_body(b'{"model": "m"}', protocol.ChatCompletionRequest)
    with pytest.raises(protocol.APIError, match="'tool_choice' needs 'tools'"):
        protocol.parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}',
                            protocol.ChatCompletionRequest)
    req = protocol.parse_body(b'{"model": "m", "prompt": ["abc"], "stop": "\\n", "top_k": -1, "user": "u"}',
                              protocol.CompletionRequest)
    assert req.prompt == ["abc"] and req.stop == ["\n"] and req.top_k == -1  # prompts, as a list
    req = protocol.parse_body(b'{"model": "m", "prompt": [[1, 2]]}', protocol.CompletionRequest)
    assert req.prompt == [[1, 2]]
    assert protocol.parse_body(b'{"model": "m", "prompt": [1, 2]}', protocol.CompletionRequest).prompt == [[1, 2]]
    req = protocol.parse_body(b'{"model": "m", "prompt": ["a", [3]], "n": 2}', protocol.CompletionRequest)
    assert req.prompt == ["a", [3]] and req.n == 2


def test_cli_parser_and_argument_errors():
    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--port", "9000", "--max-batch-size", "4", "--no-draft",
                              "--served-model-name", "m", "--api-key", "k"])
    assert args.func is run_serve and args.port == 9000 and args.max_batch_size == 4 and args.no_draft
    assert args.api_key == "k" and args.served_model_name == "m" and args.max_queue == 64
    bad = parser.parse_args(["serve", "--max-batch-size", "0"])
    with pytest.raises(ValueError, match="--max-batch-size must be >= 1"):
        run_serve(bad)
    assert parser.parse_args(["serve", "--mixed-prefill-tokens", "0"]).mixed_prefill_tokens == 0
    with pytest.raises(SystemExit):  # argparse: one line on stderr, exit 2
        parser.parse_args(["serve", "--mixed-prefill-tokens", "-1"])
    both = parser.parse_args(["serve", "--no-draft", "--draft", "x", "--target", "y"])
    with pytest.raises(ValueError, match="contradict"):
        from flashdraft.serve.cli import build_engine

        build_engine(both)


def test_chat_template_flag(tmp_path):
    """--chat-template: a file or the template's text replaces the tokenizer's; a missing file is refused before the
    models load, a template that cannot render a conversation at start-up, each with one error."""
    from flashdraft.serve.cli import build_engine

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    for value in (str(path), template):
        engine, _ = build_engine(parser.parse_args(["serve", "--no-draft", "--device", "cpu", "--chat-template",
                                                    value]))
        assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "x = 1"}], tokenize=False) == \
            "<user>x = 1"
    with pytest.raises(ValueError, match="no such file"):
        build_engine(parser.parse_args(["serve", "--no-draft", "--target", str(tmp_path / "absent"),
                                        "--chat-template", str(tmp_path / "none.jinja")]))
    with pytest.raises(ValueError, match="does not render"):
        build_engine(parser.parse_args(["serve", "--no-draft", "--device", "cpu", "--chat-template",
                                        "{{ messages[0]['nope'].x }}{% if %}"]))


def test_cycle_trace_file_is_appended_and_a_bad_path_is_one_error(tmp_path):
    from flashdraft.serve.cli import open_cycle_trace

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).cycle_trace is None and open_cycle_trace(None) is None
    path = tmp_path / "trace.jsonl"
    path.write_text('{"ms": 1}\n')
    with open_cycle_trace(str(path)) as trace:  # appended to, not truncated
        trace.write('{"ms": 2}\n')
    assert path.read_text() == '{"ms": 1}\n{"ms": 2}\n'
    bad = parser.parse_args(["serve", "--no-draft", "--cycle-trace", str(tmp_path / "missing" / "trace.jsonl")])
    with pytest.raises(ValueError, match="--cycle-trace .*missing.*cannot write it"):
        run_serve(bad)  # before anything loads


def test_serve_target_without_draft_is_refused_not_silently_plain():
    from flashdraft.serve.cli import build_engine

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(ValueError, match="--target needs --draft"):
        build_engine(parser.parse_args(["serve", "--target", "/nonexistent/model"]))


def test_startup_line_names_the_target_path():
    assert SpecEngine(make_target("gemma2")).target_path == "fast target path"
    assert SpecEngine(make_target("qwen3"), fast_path=False).target_path == "generic target path: fast_path=False"
    assert SpecEngine(make_target("olmo2")).target_path.startswith("generic target path: model_type 'olmo2'")
