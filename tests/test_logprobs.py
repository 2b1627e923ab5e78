"""Log-probabilities of committed tokens (`SamplingParams.logprobs`).

Each reported figure is compared with the target's own: transformers' forward over the prompt and the output in one
pass, log_softmax at the position that chose each token (the raw distribution, before temperature and top-k). Cases
drive every way a token is committed: accepted drafts of every length (an oracle drafter), the target's own token
after a rejection, one-token steps, an answer's first token from the prefill, rows beside rows that do not ask, both
target paths, the screened greedy read-out of the shipped pair, sampling, stop ids and stop strings, streaming.
Asking for log-probabilities must not change a token.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.loading import load_pair
from tiny import engine_with, greedy_reference, make_drafter, make_target

PROMPTS = [[3, 17, 42, 8, 11], [5, 9], [60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


@torch.inference_mode()
def reference_logprobs(target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: the target's log_softmax at the positions that chose each output token."""
    logits = target(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)]
    return torch.log_softmax(logits.double(), dim=-1)


def check_logprobs(result, reference: torch.Tensor, k: int, tol: float) -> None:
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for j, (entry, token) in enumerate(zip(result.logprobs, result.token_ids)):
        assert entry.token == token
        assert entry.logprob == pytest.approx(reference[j, token].item(), abs=tol), f"position {j}"
        values, ids = reference[j].topk(k)
        assert [t for t, _ in entry.top] == ids.tolist(), f"position {j}"
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=tol)


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("proposer", ["oracle", "dflash", "none"])
def test_greedy_logprobs_are_the_targets_own(target, fast_path, proposer):
    max_new = 30
    expected = [greedy_reference(target, p, max_new) for p in PROMPTS]
    engine = engine_with(proposer, target, PROMPTS, expected, fast_path, seed=2)
    asks = [SamplingParams(max_new_tokens=max_new, logprobs=5), SamplingParams(max_new_tokens=max_new, logprobs=0),
            SamplingParams(max_new_tokens=max_new)]
    results = engine.generate(PROMPTS, asks)
    assert [r.token_ids for r in results] == expected
    check_logprobs(results[0], reference_logprobs(target, PROMPTS[0], expected[0]), 5, 1e-9)
    check_logprobs(results[1], reference_logprobs(target, PROMPTS[1], expected[1]), 0, 1e-9)
    assert results[2].logprobs is None
    if proposer == "oracle":  # accepted drafts of several lengths reached the log-probabilities
        assert max(results[0].stats.acceptance_lengths) >= 4 and min(results[0].stats.acceptance_lengths) <= 2


def test_rows_that_ask_verify_chains_where_the_engine_builds_trees(target):
    engine = SpecEngine(target, make_drafter(target, block_size=8), tree_budget=16)
    expected = [greedy_reference(target, p, 20) for p in PROMPTS]
    results = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=20, logprobs=1)] * len(PROMPTS))
    assert [r.token_ids for r in results] == expected
    for prompt, result in zip(PROMPTS, results):
        check_logprobs(result, reference_logprobs(target, prompt, result.token_ids), 1, 1e-9)


def test_sampled_tokens_do_not_change_and_report_the_raw_distribution(target):
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    base = dict(max_new_tokens=24, temperature=0.7, top_k=20, seed=123)
    plain = engine.generate(PROMPTS, SamplingParams(**base))
    asked = engine.generate(PROMPTS, SamplingParams(**base, logprobs=2))
    for prompt, p, a in zip(PROMPTS, plain, asked):
        assert a.token_ids == p.token_ids
        check_logprobs(a, reference_logprobs(target, prompt, a.token_ids), 2, 1e-9)


def test_stops_and_streaming_keep_one_figure_per_token(target):
    engine = SpecEngine(target, make_drafter(target, block_size=8))
    free = greedy_reference(target, PROMPTS[0], 20)
    stop = free[7]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(stop,), logprobs=1)
    events = list(engine.stream([PROMPTS[0]], params))
    result = events[-1].result
    assert result.token_ids == free[:free.index(stop) + 1] and result.finish_reason == "stop"
    streamed = [e for event in events for e in event.logprobs]
    assert streamed == result.logprobs
    check_logprobs(result, reference_logprobs(target, PROMPTS[0], result.token_ids), 1, 1e-9)


@pytest.mark.parametrize("value", [-1, 21, True, 1.0])
def test_out_of_range_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)


@torch.inference_mode()
def test_shipped_pair_screened_read_out_and_stop_strings():
    """The shipped pair in float32 with its default engine (screened greedy read-out where the CPU has it): asking
    turns the screen off for that cycle and the tokens stay the target's own `generate`'s; a stop string's cut
    keeps one figure per kept token."""
    model, tokenizer, drafter = load_pair(device="cpu", dtype="float32")
    # the fixed block: the same verify shapes every run (the default policy's widths follow timings, and a verify
    # of another width rounds a near-tie its own way, which would make the comparison with `generate` flaky)
    engine = SpecEngine(model, drafter, tokenizer, draft_policy="fixed")
    prompts = [tokenizer.encode("def fibonacci(n):\n"), tokenizer.encode("import os\nimport sys\n\n\ndef main(")]
    asks = [SamplingParams(max_new_tokens=40, logprobs=3), SamplingParams(max_new_tokens=40)]
    results = engine.generate(prompts, asks)
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert result.token_ids == want
    check_logprobs(results[0], reference_logprobs(model, prompts[0], results[0].token_ids), 3, 2e-4)
    assert results[0].stats.num_drafts > 0
    text = results[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # may start inside a token: the cut keeps that token
    cut = engine.generate([prompts[0]], SamplingParams(max_new_tokens=40, logprobs=0, stop_strings=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    assert len(cut.logprobs) == len(cut.token_ids) and cut.token_ids == results[0].token_ids[:len(cut.token_ids)]
    # streamed: each event's figures are its tokens' (a stop string cuts only tokens of the cycle that completes
    # it, before their event), and they add up to the result's
    out_text, figures = "", []
    for event in engine.stream([prompts[0]], SamplingParams(max_new_tokens=40, logprobs=0, stop_strings=(stop,))):
        assert [e.token for e in event.logprobs] == event.token_ids
        out_text, figures = out_text + (event.text or ""), figures + event.logprobs
    assert out_text == cut.text and figures == cut.logprobs
    engine.close()


@pytest.mark.parametrize("chunk", [None, 3], ids=["one-forward", "chunks-of-3"])
def test_prompt_logprobs_are_the_targets_own(target, monkeypatch, chunk):
    """`prompt_logprobs`: each prompt token's figure given the tokens before it (None for the first), for rows
    prefilled by `add` and rows whose prompts ride a running batch's cycle (`step`), in chunks of positions or not."""
    from flashdraft.engine import logprobs

    if chunk:
        monkeypatch.setattr(logprobs, "PROMPT_LOGITS_CHUNK", chunk * target.config.vocab_size)
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    batch = engine.open_batch()
    first = engine.add(batch, [PROMPTS[2]], SamplingParams(max_new_tokens=12, prompt_logprobs=2), request_ids=["a"])
    assert engine.rides_cycle(batch, [SimpleNamespace(prompt=PROMPTS[0]), SimpleNamespace(prompt=PROMPTS[1])])
    joined = engine.step(batch, [PROMPTS[0], PROMPTS[1]], [SamplingParams(max_new_tokens=4, prompt_logprobs=0),
                                                             SamplingParams(max_new_tokens=4)], request_ids=["b", "c"])
    events = {e.index: e for e in first + joined if e.prompt_logprobs is not None}
    assert sorted(events) == ["a", "b"]  # once, on the first event; never for a row that did not ask
    for rid, prompt, k in (("a", PROMPTS[2], 2), ("b", PROMPTS[0], 0)):
        got = events[rid].prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        reference = torch.log_softmax(target(torch.tensor([prompt])).logits[0].double(), dim=-1)
        for p in range(1, len(prompt)):
            assert got[p].token == prompt[p] and got[p].logprob == pytest.approx(reference[p - 1, prompt[p]].item(),
                                                                                abs=1e-9)
            assert [t for t, _ in got[p].top] == reference[p - 1].topk(k).indices.tolist()
    while batch.rows:
        for e in engine.step(batch):
            if e.finished and e.index == "a":
                assert e.result.prompt_logprobs == events["a"].prompt_logprobs
    assert engine.generate([[7]], SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0].prompt_logprobs == [None]


def test_choices_of_one_prompt_share_its_scoring_forward(target, monkeypatch):
    """A request's n choices are rows with the same prompt: its figures are computed once for all of them (a
    completions request with n = 4 and echo ran the prompt's forward four times), and each gets them."""
    from flashdraft.engine import generate

    calls = []
    real = generate.prompt_logprobs
    monkeypatch.setattr(generate, "prompt_logprobs", lambda *a: calls.append(a[1:]) or real(*a))
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    params = [SamplingParams(max_new_tokens=3, prompt_logprobs=k, temperature=1.0, seed=i)
              for i, k in enumerate((2, 2, 2, 1))]
    results = engine.generate([PROMPTS[0]] * 4, params) + engine.generate(
        [PROMPTS[1]], SamplingParams(max_new_tokens=2, prompt_logprobs=2))
    assert calls == [(PROMPTS[0], 2), (PROMPTS[0], 1), (PROMPTS[1], 2)]  # per distinct prompt and figure count
    assert results[0].prompt_logprobs == results[1].prompt_logprobs == results[2].prompt_logprobs
    assert [len(e.top) for e in results[3].prompt_logprobs[1:]] == [1] * (len(PROMPTS[0]) - 1)
    alone = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, prompt_logprobs=2))[0]
    assert alone.prompt_logprobs == results[0].prompt_logprobs
