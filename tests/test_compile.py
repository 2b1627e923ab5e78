"""Compiled draft and verify steps (SpecEngine(compile=True)): still lossless, and one graph per block size.

Skipped where torch.compile cannot build CPU kernels (no C++ compiler).
"""

from __future__ import annotations

import pytest
import torch

from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.engine.compiled import compile_unavailable
from flashdraft.engine.batch import batch_bucket
from flashdraft.model import slots
from tiny import OracleProposer, greedy_reference, make_drafter, make_target

pytestmark = pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                reason=str(compile_unavailable(torch.device("cpu"))))

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30, 12, 4, 19, 22], list(range(20, 58))]
MAX_NEW = 24


@pytest.fixture(scope="module")
def qwen3():
    target = make_target("qwen3")
    return target, [greedy_reference(target, p, MAX_NEW) for p in PROMPTS]


def test_compiled_dflash_is_lossless_and_does_not_recompile_per_request(qwen3):
    target, expected = qwen3
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=True)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    assert engine.generate([PROMPTS[0]], params)[0].token_ids == expected[0]
    # other prompt lengths at batch 1 reuse the same graphs: shapes are static per block size
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt, want in zip(PROMPTS[1:], expected[1:]):
            assert engine.generate([prompt], params)[0].token_ids == want
    # a batch of rows with different lengths (a new batch shape: recompiles are allowed here)
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected


def test_compiled_engine_with_prefix_cache_hits_stays_lossless(qwen3):
    """Prefix-cache hits prefill the rest of a prompt eagerly beside the compiled steps (`PagedTargetKV.prefill`'s
    ragged path); the rows then decode through the compiled graphs as any other."""
    target, _ = qwen3
    shared = list(range(1, 70))
    prompts = [shared + [5], shared + [6, 7, 8], shared[:64] + [9, 9]]
    expected = [greedy_reference(target, p, MAX_NEW) for p in prompts]
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=True, prefix_cache_tokens=256)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    apart = [engine.generate([p], params)[0] for p in prompts]
    assert [r.token_ids for r in apart] == expected
    assert [r.stats.cached_tokens for r in apart] == [0, 64, 64]
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected


def test_compiled_verify_with_long_accepted_runs(qwen3):
    """The oracle drafter gets whole blocks accepted, then rejected at random positions, across rows."""
    target, expected = qwen3
    refs = {i: p + e for i, (p, e) in enumerate(zip(PROMPTS, expected))}
    engine = SpecEngine(target, block_size=6, proposer=OracleProposer(refs, seed=3), compile=True)
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == expected
    assert max(max(r.stats.acceptance_lengths) for r in results) == 6  # some whole blocks accepted


def test_warmup_compiles_every_batch_bucket_so_requests_never_recompile(qwen3):
    target, expected = qwen3
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=True)
    assert engine.warmup(4) == [1, 2, 4]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    with torch._dynamo.config.patch(error_on_recompile=True):  # 3 rows run padded to 4, as do 4
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected
        assert [r.token_ids for r in engine.generate(PROMPTS + PROMPTS[:1], params)] == expected + expected[:1]
        assert engine.generate(PROMPTS[1:2], params)[0].token_ids == expected[1]
    assert SpecEngine(target, make_drafter(target, block_size=4)).warmup(4) == [1, 2, 4]  # eager: timed only
    assert SpecEngine(target).warmup(4) == []  # eager plain decoding: nothing to compile or plan


def test_growing_caches_keep_one_graph_per_bucket(qwen3, monkeypatch):
    """Paged caches grow as rows advance (pools by pages, page tables in chunks of 16 positions here) and shrink
    when rows leave; pool size and table width are dynamic dimensions of the compiled steps, so after warm-up (one
    small capacity) no size compiles again."""
    monkeypatch.setattr(slots, "TABLE_POSITIONS", 16)
    target, expected = qwen3
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=True, kv_page_size=8)
    engine.warmup(4)
    capacities = set()
    step = engine.step

    def recording(batch, *joining, **named):
        capacities.add(batch.kv.kv.capacity)
        return step(batch, *joining, **named)

    engine.step = recording
    params = SamplingParams(max_new_tokens=MAX_NEW)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected
        assert engine.generate(PROMPTS[:1], params)[0].token_ids == expected[0]
    assert {16, 32, 48, 64} <= capacities  # 3 to 38 tokens + 24 + a block


def test_compiled_continuous_batching_rows_join_and_leave(qwen3):
    """Rows finish at different times and new rows join a running batch: the caches stay padded to the bucket
    of the live row count, and every row still gets exactly the target's greedy output."""
    target, expected = qwen3
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=True)
    first = [SamplingParams(max_new_tokens=n) for n in (6, MAX_NEW, 13)]
    batch = engine.open_batch()
    outputs: dict = {}

    def collect(events):
        for e in events:
            outputs.setdefault(e.index, []).extend(e.token_ids)
        assert batch.kv is None or not batch.rows or batch.kv.kv.batch == batch_bucket(len(batch.rows))

    collect(engine.add(batch, PROMPTS, first, request_ids=["a0", "a1", "a2"]))
    collect(engine.step(batch))
    collect(engine.step(batch))
    collect(engine.add(batch, PROMPTS[::-1], SamplingParams(max_new_tokens=MAX_NEW), request_ids=["b2", "b1", "b0"]))
    while batch.rows:
        collect(engine.step(batch))
    for i, p in enumerate(first):
        assert outputs[f"a{i}"] == expected[i][:p.max_new_tokens]
        assert outputs[f"b{i}"] == expected[i]


def test_compile_needs_the_fast_path():
    target = make_target("olmo2")
    with pytest.raises(ValueError, match="fast target path"):
        SpecEngine(target, make_drafter(target), compile=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)"))])
def test_compiled_mixture_of_experts_target_is_lossless_and_eager_experts_are_refused(device):
    """A Qwen3-MoE target's expert layers run inside the compiled verify (CUDA graphs on GPU) through transformers'
    grouped_mm experts; its 'eager' experts (a loop over the experts a batch routes to) cannot be traced, and say so
    up front."""
    target = make_target("qwen3_moe", dtype=torch.float32).to(device)
    with pytest.raises(ValueError, match="'eager' experts implementation"):
        SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.float32).to(device), compile=True)
    target.set_experts_implementation("grouped_mm")
    prompts = PROMPTS[:2]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        expected.append(target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                        attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist())
    engine = SpecEngine(target, block_size=4, compile=True,
                        proposer=OracleProposer([p + e for p, e in zip(prompts, expected)], seed=2))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_tokens for r in results) > 0  # blocks were verified, not only one-token steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
def test_cuda_graphs_lossless_while_rows_come_and_go_in_place():
    """On CUDA the steps replay CUDA graphs: rows leaving within a bucket keep the page table's address (the
    pools move only when they grow or are compacted)."""
    target = make_target("qwen3", dtype=torch.float32).cuda()
    engine = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.float32).cuda(), compile=True)
    assert engine.warmup(4) == [1, 2, 4]
    prompts, budgets = PROMPTS + PROMPTS[:1], [6, MAX_NEW, 13, MAX_NEW]
    batch = engine.open_batch()
    outputs = {i: e.token_ids for i, e in enumerate(engine.add(batch, prompts, [
        SamplingParams(max_new_tokens=n) for n in budgets]))}
    address = batch.kv.kv.table.data_ptr()
    while batch.rows:
        for e in engine.step(batch):
            outputs[e.index] = outputs[e.index] + e.token_ids
        if len(batch.rows) >= 3:  # 4 or 3 live rows: bucket 4, same tensors
            assert batch.kv.kv.table.data_ptr() == address
    for i, (prompt, n) in enumerate(zip(prompts, budgets)):
        ids = torch.tensor([prompt], device="cuda")
        want = target.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
        assert outputs[i] == want, i
