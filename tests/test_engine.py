"""Engine behaviour beyond losslessness: streaming, stop strings, per-request statistics, row bookkeeping."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft import SamplingParams, SpecEngine
from flashdraft.model.slots import pages_for
from tiny import OracleProposer, greedy_reference, load_tokenizer, make_drafter, make_target



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


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("use_drafter", [True, False], ids=["dflash", "oracle"])
def test_continuous_batching_join_leave_cancel(use_drafter, fast_path):
    """Requests join a running batch between cycles and leave when done; outputs equal each request served alone."""
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
        if arrivals and cycle % 2 == 1:
            rid = arrivals.pop(0)
            collect(engine.add(batch, [prompts[rid]], SamplingParams(max_new_tokens=budgets[rid]), request_ids=[rid]))
        if cycle == 3:
            assert engine.cancel(batch, "r1") and all(r.index != "r1" for r in batch.rows)
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
