"""Engine behaviour beyond losslessness: streaming, stop strings, per-request statistics, row bookkeeping."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft import SamplingParams, SpecEngine
from flashdraft.model.slots import pages_for
from tiny import OracleProposer, drain, finished, greedy_reference, load_tokenizer, make_drafter, make_target



@pytest.fixture(scope="module")
def text_model():
    tok = load_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return Qwen3ForCausalLM(cfg).double().eval(), tok


def test_stream_concatenates_to_final_result(text_model):
    model, tok = text_model
    prompts = [tok("def main():")["input_ids"], tok("class Foo(object):\n    ")["input_ids"]]
    refs = [p + greedy_reference(model, p, 30) for p in prompts]
    engine = SpecEngine(model, tokenizer=tok, block_size=6, proposer=OracleProposer(refs, vocab=len(tok)))
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=11)]
    tokens, texts, results = {0: [], 1: []}, {0: "", 1: ""}, {}
    order = []
    for ev in engine.stream(prompts, params):
        tokens[ev.index] += ev.token_ids
        texts[ev.index] += ev.text
        if ev.finished:
            results[ev.index] = ev.result
            order.append(ev.index)
    assert order == [1, 0]  # the shorter request finishes (and leaves the batch) first
    for i in (0, 1):
        assert tokens[i] == results[i].token_ids == refs[i][len(prompts[i]):][: params[i].max_new_tokens]
        assert texts[i] == results[i].text == tok.decode(results[i].token_ids, skip_special_tokens=True)
        assert results[i].finish_reason == "length"


def test_stop_string_truncates_text_and_tokens(text_model):
    model, tok = text_model
    prompt = tok("x = 1")["input_ids"]
    full = greedy_reference(model, prompt, 40)
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[10:13]
    assert stop and stop in text
    engine = SpecEngine(model, tokenizer=tok, block_size=4, proposer=OracleProposer([prompt + full], vocab=len(tok)))
    res = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop_strings=(stop,)))[0]
    assert res.finish_reason == "stop"
    assert res.text == text[: text.index(stop)]
    assert stop in tok.decode(res.token_ids) and stop not in tok.decode(res.token_ids[:-1])
    with_stop = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop_strings=(stop,),
                                                         include_stop_str_in_output=True))[0]
    assert with_stop.text == text[: text.index(stop) + len(stop)]


def test_statistics_are_consistent():
    target = make_target("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    refs = [p + greedy_reference(target, p, 50) for p in prompts]
    engine = SpecEngine(target, block_size=8, proposer=OracleProposer(refs, corrupt=0.5, seed=2),
                        draft_policy="fixed")  # every cycle drafts (test_policy.py covers mixed widths)
    for res in engine.generate(prompts, SamplingParams(max_new_tokens=50)):
        s = res.stats
        assert s.output_tokens == 50 == len(res.token_ids)
        assert sum(s.histogram) == s.num_drafts == len(s.acceptance_lengths)
        assert abs(s.tau - sum(s.acceptance_lengths) / s.num_drafts) < 1e-12
        # every cycle commits its acceptance length; the last may be cut by max_new_tokens; +1 for the prefill token
        assert sum(s.acceptance_lengths) + 1 >= 50 > sum(s.acceptance_lengths[:-1]) + 1
        assert s.per_position_acceptance[0] >= s.per_position_acceptance[-1]
        assert s.time_to_first_token > 0 and s.decode_time > 0 and s.tokens_per_second > 0
        d = s.to_dict()
        assert d["tau"] == round(s.tau, 4) and len(d["per_position_acceptance"]) == 7


def test_the_cycle_trace_accounts_for_every_committed_token():
    """`SpecEngine.cycle_trace` gets one record per decode cycle: the requests in the batch, each one's verify width
    and drafts accepted, the requests that joined in it. Per request, the cycles' acceptance lengths (accepted + 1)
    after its first token cover its output, and all but its last cycle's fall short of it; rides are counted."""
    target = make_target("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [7, 3], [2, 8, 1, 5]]
    refs = [p + greedy_reference(target, p, 30) for p in prompts]
    engine = SpecEngine(target, block_size=8, proposer=OracleProposer(refs, corrupt=0.5, seed=3))
    records = []
    engine.cycle_trace = records.append
    batch, outputs = engine.open_batch(), {}
    list(engine.add(batch, prompts[:2], SamplingParams(max_new_tokens=30), request_ids=[0, 1]))
    engine.step(batch)
    events = engine.step(batch, prompts[2:], SamplingParams(max_new_tokens=30), request_ids=[2, 3])  # they ride
    while True:
        outputs.update({ev.index: ev.result.token_ids for ev in events if ev.finished})
        if not batch.rows:
            break
        events = engine.step(batch)
    assert [outputs[i] for i in range(4)] == [greedy_reference(target, p, 30) for p in prompts]
    assert [r["joined"] for r in records].count(2) == 1 and sum(r["joined"] for r in records) == 2
    assert any(max(r["widths"]) > 1 for r in records) and any(r["ms"] > 0 for r in records)
    assert {r["decision"] for r in records} <= {"plan", "kept", "probe", "held", "refresh", "unmeasured",
                                                 "unmeasured load"}
    cycles = {i: [] for i in range(4)}
    for r in records:
        assert len(r["requests"]) == len(r["widths"]) == len(r["accepted"])
        for req, width, accepted in zip(r["requests"], r["widths"], r["accepted"]):
            assert 0 <= accepted <= width - 1
            cycles[req].append(accepted + 1)
    for req, lengths in cycles.items():
        assert 1 + sum(lengths) >= 30 > 1 + sum(lengths[:-1])


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_batches_above_disable_by_batch_size_take_one_token_steps(policy):
    """vLLM's disable_by_batch_size: a cycle of more rows than the limit verifies one token per row (no drafts,
    no lookup continuations, the policy not asked: decision "capped"); at or below it the policy decides (fixed:
    the whole block). Outputs stay the target's own greedy ones whatever the load did."""
    target = make_target("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [7, 3], [2, 8, 1, 5]]
    lengths = [6, 30, 12, 30]  # rows leave one by one: the batch falls from 4 rows to 1
    refs = [p + greedy_reference(target, p, n) for p, n in zip(prompts, lengths)]
    engine = SpecEngine(target, block_size=8, proposer=OracleProposer(refs), draft_policy=policy,
                        disable_by_batch_size=2)
    records = []
    engine.cycle_trace = records.append
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    assert [r.token_ids for r in results] == [greedy_reference(target, p, n) for p, n in zip(prompts, lengths)]
    above = [r for r in records if len(r["requests"]) > 2]
    below = [r for r in records if len(r["requests"]) <= 2]
    assert above and below
    assert all(r["decision"] == "capped" and r["widths"] == [1] * len(r["requests"]) and not r["lookups"]
               for r in above)
    assert all(r["decision"] != "capped" for r in below) and any(max(r["widths"]) > 1 for r in below)
    if policy == "fixed":
        assert all(r["widths"] == [8] * len(r["requests"]) for r in below)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpecEngine(target, block_size=8, proposer=OracleProposer(refs), disable_by_batch_size=-1)


def test_the_disable_by_batch_size_flag_reaches_the_engine(capsys):
    from flashdraft.args import engine_config
    from flashdraft.cli import build_parser

    for command in (["serve"], ["bench"], ["demo"], ["generate", "--prompt", "x"]):
        args = build_parser().parse_args([*command, "--speculative-disable-by-batch-size", "8"])
        assert engine_config(args).disable_by_batch_size == 8
        assert engine_config(args, plain=True).disable_by_batch_size == 8  # plain decoding never drafts anyway
    assert engine_config(build_parser().parse_args(["serve"])).disable_by_batch_size == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-disable-by-batch-size", "-1"])
    assert "must be an integer >= 0" in capsys.readouterr().err


def test_block_size_one_is_plain_decoding():
    target = make_target("qwen2")
    engine = SpecEngine(target, make_drafter(target), block_size=1)
    res = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=12))[0]
    assert engine.block_size == 1 and res.token_ids == greedy_reference(target, [3, 4, 5], 12)
    assert res.stats.acceptance_lengths == [] and res.stats.plain_steps == 11  # no draft, no acceptance figures


def test_prompt_tensor_and_reference_signature():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=16)
    out = drafter.spec_generate(target=target, input_ids=torch.tensor([[7, 8, 9]]), max_new_tokens=10,
                                stop_token_ids=[], temperature=0.0)
    assert out[0, :3].tolist() == [7, 8, 9] and out[0, 3:].tolist() == greedy_reference(target, [7, 8, 9], 10)


@pytest.mark.parametrize("join", ["add", "step"])
@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("use_drafter", [True, False], ids=["dflash", "oracle"])
def test_continuous_batching_join_leave_cancel(use_drafter, fast_path, join):
    """Requests join a running batch between cycles (`add`, or `step` with their prompts: on the fast path they
    ride the cycle's forward) and leave when done; outputs equal each request served alone."""
    target = make_target("mistral")
    prompts = {f"r{i}": [(7 * i + j) % 90 for j in range(3 + 5 * i)] for i in range(10)}
    budgets = {rid: 10 + 4 * i for i, rid in enumerate(prompts)}
    budgets["r1"] = 120  # still running when it is cancelled
    expected = {rid: greedy_reference(target, p, budgets[rid]) for rid, p in prompts.items()}
    if use_drafter:
        engine = SpecEngine(target, make_drafter(target, block_size=4), fast_path=fast_path)
    else:
        engine = SpecEngine(target, block_size=5, fast_path=fast_path,
                            proposer=OracleProposer({rid: prompts[rid] + expected[rid] for rid in prompts}, seed=1))
    batch = engine.open_batch()
    results, arrivals = {}, list(prompts)

    def collect(events):
        for ev in events:
            if ev.finished:
                results[ev.index] = ev.result

    collect(engine.add(batch, [prompts["r0"], prompts["r1"]], [SamplingParams(max_new_tokens=budgets["r0"]),
                                                               SamplingParams(max_new_tokens=budgets["r1"])],
                       request_ids=["r0", "r1"]))
    arrivals = arrivals[2:]
    cycle = 0
    while batch.rows or arrivals:
        joining = []
        if arrivals and cycle % 2 == 1:
            rid = arrivals.pop(0)
            if join == "add":
                collect(engine.add(batch, [prompts[rid]], SamplingParams(max_new_tokens=budgets[rid]),
                                   request_ids=[rid]))
            else:
                joining = [rid]
        if cycle == 3:
            assert engine.cancel(batch, "r1") and all(r.index != "r1" for r in batch.rows)
        if joining:
            collect(engine.step(batch, [prompts[rid] for rid in joining],
                                [SamplingParams(max_new_tokens=budgets[rid]) for rid in joining], request_ids=joining))
        else:
            collect(engine.step(batch))
        cycle += 1
        if batch.rows:  # holes and finished rows' columns are compacted away: caches stay bounded
            live = max(r.n_cached for r in batch.rows)
            if engine.fast is None:
                assert batch.kv.slot_mask.shape[1] <= 2 * live + 2 * engine.block_size
            caches = [(batch.kv.kv, False)] if engine.fast is not None else []
            if use_drafter:
                caches.append((batch.proposer_state.kv, True))
            # paged: one row per request, each owning pages for its own tokens and next block (the drafter's: for
            # the context written to it, its pending context takes pages when it is written)
            for kv, drafter in caches:
                assert kv.batch == len(batch.rows)
                for r, pages in zip(batch.rows, kv.pages):
                    assert pages_for(r.n_cached - (r.pending.length if drafter else 0), kv.page_size) <= len(pages)
                    assert len(pages) <= pages_for(r.n_cached + engine.block_size, kv.page_size)
    assert "r1" not in results
    for rid in prompts:
        if rid != "r1":
            assert results[rid].token_ids == expected[rid], rid


def test_each_row_holds_pages_for_its_own_tokens_and_gives_them_back_when_it_leaves():
    """Paged caches (pages of 16 positions here): each row owns pages for its committed tokens plus a block, not
    the longest row's; the long row's pages go back when it leaves; the output stays the target's own. The
    drafter's cache is allocated at the first draft, not at prefill."""
    target = make_target("qwen3")
    long_prompt, short_prompt = list(range(20, 58)), [5, 17, 3]
    expected = [greedy_reference(target, long_prompt, 4), greedy_reference(target, short_prompt, 40)]
    engine = SpecEngine(target, make_drafter(target, block_size=4), kv_page_size=16, draft_policy="fixed")
    batch = engine.open_batch()
    params = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=40)]
    outputs = {i: ev.token_ids for i, ev in enumerate(engine.add(batch, [long_prompt, short_prompt], params))}
    target_kv = batch.kv.kv
    assert [len(p) for p in target_kv.pages] == [3, 1]  # 38 + a block of 4 in pages of 16; 3 + 4
    assert batch.proposer_state.kv is None  # nothing written to the drafter yet
    held = []  # the short row's tokens once it is alone
    while batch.rows:
        for ev in engine.step(batch):
            outputs[ev.index] = outputs[ev.index] + ev.token_ids
        draft_kv = batch.proposer_state.kv if batch.rows else draft_kv  # (an emptied batch starts afresh)
        for kv in (target_kv, draft_kv):
            for r, pages in zip(batch.rows, kv.pages):
                assert pages_for(r.n_cached, 16) <= len(pages) <= pages_for(r.n_cached + 4, 16)
        if len(batch.rows) == 1:  # the long row left: only the short row's pages are held
            held.append(batch.rows[0].n_cached)
            assert target_kv.batch == 1 and target_kv.held_pages == len(target_kv.pages[0])
            assert draft_kv.batch == 1 and draft_kv.held_pages == len(draft_kv.pages[0])
    assert held and held[0] < 16 < held[-1]  # the short row alone, from one page to more
    assert [outputs[0], outputs[1]] == expected


def test_lower_precision_drafter_is_lossless_and_still_drafts_well():
    """A bf16 drafter for an fp32 target (the CPU default where bf16 is native): drafts only steer acceptance."""
    from flashdraft.demo import load_heldout_prompts
    from flashdraft.loading import load_pair, resolve_draft_dtype

    target, tok, drafter = load_pair(device="cpu", dtype="float32", draft_dtype="bfloat16")
    assert (target.dtype, drafter.dtype) == (torch.float32, torch.bfloat16)
    # the fp32 comparison drafter is its own copy (same weights, upcast): the bf16 one is never converted in place
    full_drafter = copy.deepcopy(drafter).float()
    # 8 prompts: on 4 the two precisions happened to draft alike throughout with one of the shipped drafters
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in load_heldout_prompts(8)]
    params = SamplingParams(max_new_tokens=64, stop_token_ids=(tok.eos_token_id,))
    plain = SpecEngine(target, None).generate(prompts, params)
    # the fixed policy: every cycle drafts, so the acceptance compared below does not follow the machine's timing
    spec = SpecEngine(target, drafter, draft_policy="fixed").generate(prompts, params)
    full = SpecEngine(target, full_drafter, draft_policy="fixed").generate(prompts, params)
    assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}  # it ran, and stayed, in bf16
    assert {p.dtype for p in full_drafter.parameters()} == {torch.float32}
    assert target.dtype == torch.float32
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain] == [r.token_ids for r in full]
    # the two precisions draft differently somewhere (else the bf16 drafter was not what ran), yet close in quality
    assert [r.stats.acceptance_lengths for r in spec] != [r.stats.acceptance_lengths for r in full]
    tau = lambda results: sum(sum(r.stats.acceptance_lengths) for r in results) / sum(  # noqa: E731
        r.stats.num_drafts for r in results)
    assert tau(full) > 2.5 and tau(spec) > 0.9 * tau(full), (tau(spec), tau(full))
    assert resolve_draft_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    assert resolve_draft_dtype("float32", torch.bfloat16, "cpu") == torch.float32


def _count_calls(monkeypatch, owner, name: str) -> list:
    calls = []
    original = getattr(owner, name)

    def counted(self, *args, **kwargs):  # records the prompt groups a ragged forward prefills
        calls.append(kwargs.get("prompts", args[3] if name == "forward_ragged" and len(args) > 3 else ()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])  # Gemma 2: windows shorter than the contexts, capped logits
@pytest.mark.parametrize("use_drafter", [True, False], ids=["dflash", "plain"])
def test_joining_prompts_ride_the_cycle_forward_and_stay_lossless(monkeypatch, use_drafter, arch):
    """Requests joining a running batch in `step` are prefilled inside the cycle's one target forward (no prefill
    forward of their own), greedy and seeded sampled ones alike, and every output is the one the request gets
    alone: greedy = the target's own greedy decoding, sampled = plain decoding's with the same seed."""
    from flashdraft.model.fast_target import FastTarget

    target = make_target(arch)
    prompts = [[(11 * i + j) % 90 for j in range(4 + 3 * i)] for i in range(6)]
    params = [SamplingParams(max_new_tokens=14 + i, temperature=0.0 if i % 2 == 0 else 1.0, seed=i)
              for i in range(6)]
    plain = SpecEngine(target)
    alone = [plain.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    for i in range(0, 6, 2):
        assert alone[i] == greedy_reference(target, prompts[i], params[i].max_new_tokens)
    engine = SpecEngine(target, make_drafter(target, block_size=4)) if use_drafter else plain
    prefills = _count_calls(monkeypatch, FastTarget, "prefill")
    forwards = _count_calls(monkeypatch, FastTarget, "forward_ragged")
    batch = engine.open_batch()
    results = {}
    for ev in engine.add(batch, [prompts[0]], params[0], request_ids=[0]):
        assert not ev.finished
    assert len(prefills) == 1
    engine.step(batch)
    for first in (1, 3, 5):  # two requests join in one step, then two in another: each step is one forward
        ids = [first, first + 1] if first < 5 else [5]
        forwards.clear()
        events = engine.step(batch, [prompts[i] for i in ids], [params[i] for i in ids], request_ids=ids)
        assert len(prefills) == 1 and len(forwards) == 1 and len(forwards[0]) == len(ids)
        assert {ev.index for ev in events if ev.index in ids} == set(ids)  # their first tokens, out of this step
        assert {r.index for r in batch.rows} >= set(ids)
        results.update(finished(events))
    results.update(drain(engine, batch))
    assert len(prefills) == 1
    assert [results[i] for i in range(6)] == alone


def test_joins_that_cannot_ride_the_cycle_are_prefilled_first(monkeypatch):
    """An empty batch, exact mode, compiled-like padded forwards aside: a join whose prompts exceed
    `mixed_prefill_tokens`, or any join with it at 0, gets a prefill of its own, and the outputs are the same."""
    from flashdraft.model.fast_target import FastTarget

    target = make_target("qwen3")
    prompts = [[(3 * i + j) % 90 for j in range(6 + 9 * i)] for i in range(3)]
    expected = [greedy_reference(target, p, 12) for p in prompts]
    prefills = _count_calls(monkeypatch, FastTarget, "prefill")
    for limit, exact, rides in ((0, False, False), (10, False, False), (512, True, False), (512, False, True)):
        engine = SpecEngine(target, make_drafter(target, block_size=4), mixed_prefill_tokens=limit, exact=exact)
        batch = engine.open_batch()
        results = {}
        prefills.clear()
        engine.step(batch, [prompts[0]], SamplingParams(max_new_tokens=12), request_ids=[0])  # empty: apart
        assert len(prefills) == 1
        assert engine.rides_cycle(batch, engine._make_rows(prompts[1:], None)) == rides
        events = engine.step(batch, prompts[1:], SamplingParams(max_new_tokens=12), request_ids=[1, 2])
        assert len(prefills) == (1 if rides else 2)
        while True:
            for ev in events:
                if ev.finished:
                    results[ev.index] = ev.result.token_ids
            if not batch.rows:
                break
            events = engine.step(batch)
        assert [results[i] for i in range(3)] == expected, (limit, exact)


def test_a_bad_joining_request_is_refused_before_anything_runs():
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    batch = engine.open_batch()
    engine.add(batch, [[1, 2, 3]], SamplingParams(max_new_tokens=8))
    held = [r.n_cached for r in batch.rows]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.step(batch, [[4, 5], [10 ** 6]], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.check([[10 ** 6]])
    assert [r.n_cached for r in batch.rows] == held and batch.kv.num_rows == 1


def test_drafting_projections_fused_follow_weight_updates():
    """Without autograd the drafter runs q/k/v, gate/up and the context K/V as fused projections (cached copies):
    equal to the separate projections autograd runs, and rebuilt after the weights change in place (training
    between evals)."""
    from tiny import make_drafter, make_target

    drafter = make_drafter(make_target(), block_size=4)
    torch.manual_seed(0)
    width = len(drafter.target_layer_ids) * drafter.config.hidden_size
    inputs = (torch.randn(2, 4, drafter.config.hidden_size, dtype=torch.float64), torch.arange(8, 12).repeat(2, 1),
              torch.randn(2, 8, width, dtype=torch.float64), torch.arange(8).repeat(2, 1))

    def fused_and_separate():
        with torch.no_grad():
            fused = drafter(*inputs)
        separate = drafter(*inputs)  # autograd on: the projections stay apart
        assert separate.requires_grad
        return fused, separate.detach()

    fused, separate = fused_and_separate()
    torch.testing.assert_close(fused, separate)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
            layer.mlp.up_proj.weight.add_(0.01)
    fused_after, separate_after = fused_and_separate()
    torch.testing.assert_close(fused_after, separate_after)
    assert not torch.allclose(fused_after, fused)


def test_pending_context_is_taken_whole_in_order_for_every_row():
    """`take_pending`: each row's chunks, in order, from its first pending position, padded with invalid slots
    to the longest row; a row with nothing pending is all padding; the features take the drafter's dtype; nothing
    stays pending."""
    from flashdraft.engine.batch import PendingContext, take_pending

    width = 3
    chunks = {0: [torch.randn(2, width), torch.randn(1, width), torch.randn(4, width)], 2: [torch.randn(5, width)]}
    pending = [PendingContext() for _ in range(3)]
    starts = {0: 10, 2: 4}
    for i, row_chunks in chunks.items():
        at = starts[i]
        for chunk in row_chunks:
            pending[i].add(chunk, at)
            at += chunk.shape[0]
    got = take_pending(pending, width, torch.float64, torch.device("cpu"))
    assert got.values.shape == (3, 7, width) and got.values.dtype == torch.float64
    for i in range(3):
        expected = torch.cat(chunks[i]).double() if i in chunks else torch.zeros(0, width, dtype=torch.float64)
        n = expected.shape[0]
        assert got.valid[i].tolist() == [True] * n + [False] * (7 - n)
        torch.testing.assert_close(got.values[i, :n], expected, rtol=0, atol=0)
        assert not got.values[i, n:].any()
        if n:
            assert got.positions[i, :n].tolist() == list(range(starts[i], starts[i] + n))
    assert all(p.length == 0 for p in pending)
    empty = take_pending([PendingContext()], width, torch.float32, torch.device("cpu"))
    assert empty.values.shape == (1, 0, width) and empty.valid.shape == (1, 0)
    one = PendingContext()
    one.add(torch.randn(2, width), 7)
    one.add(torch.randn(3, width), 9)
    expected = torch.cat(one.values).double()
    alone = take_pending([one], width, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(alone.values[0], expected, rtol=0, atol=0)
    assert alone.positions.tolist() == [[7, 8, 9, 10, 11]] and alone.valid.all() and one.length == 0
    assert take_pending([], width, torch.float32, torch.device("cpu")).values.shape == (0, 0, width)
