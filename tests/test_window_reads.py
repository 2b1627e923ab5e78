"""Sliding-window layers read only the cache pages their window reaches (`FastTarget._window_starts`): the output
stays the target's own greedy `generate`, token for token, and the reads really start later. Small pages (4
positions) against windows of 16-24 and contexts of ~100 positions, so that most reads skip pages; every way the
engine reads the cache: one-token steps, drafted blocks, rows of different widths in one forward, token trees,
prefix-cache hits, exact mode (which reads everything: each query slices its own keys)."""

from __future__ import annotations

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.model.slots import PagedKV
from tiny import VOCAB, WINDOWED, OracleProposer, greedy_reference, make_drafter, make_target

PROMPTS = [[(7 * i + 3) % (VOCAB - 8) + 2 for i in range(n)] for n in (45, 30, 12)]
NEW_TOKENS = 40
_targets: dict = {}


def _target(arch):
    if arch not in _targets:
        _targets[arch] = make_target(arch)
    return _targets[arch]


@pytest.fixture
def read_starts(monkeypatch):
    """(the cache's window, first position read) of every `PagedKV.read` the test makes (a `GroupedKV` reads
    through one `PagedKV` per window)."""
    starts = []
    read = PagedKV.read

    def spy(self, layer, length=None, index=None, start=0):
        starts.append((self.window, start))
        return read(self, layer, length, index, start)

    monkeypatch.setattr(PagedKV, "read", spy)
    return starts


def _check(engine, target, prompts, starts, skipped: bool = True):
    expected = [greedy_reference(target, p, NEW_TOKENS) for p in prompts]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == expected
    assert any(engine.fast.windows) and all(s == 0 for window, s in starts if window is None)
    later = [s for window, s in starts if window and s > 0]
    assert bool(later) == skipped, "windowed layers read from a later page" if skipped else "exact mode reads all"
    assert all(s % engine.config.kv_page_size == 0 for s in later)
    return results


@pytest.mark.parametrize("arch", WINDOWED)
def test_windowed_layers_read_their_window_only_and_decode_as_the_target(arch, read_starts):
    target = _target(arch)
    references = [p + greedy_reference(target, p, NEW_TOKENS) for p in PROMPTS]
    engine = SpecEngine(target, block_size=8, kv_page_size=4, proposer=OracleProposer(references, seed=1))
    results = _check(engine, target, PROMPTS, read_starts)
    lengths = {a for r in results for a in r.stats.acceptance_lengths}
    assert 8 in lengths and len(lengths) >= 3  # whole blocks and partial ones


@pytest.mark.parametrize("options", [dict(tree_budget=24), dict(prefix_cache_tokens=256), dict(exact=True)],
                         ids=["trees", "prefix-cache", "exact"])
def test_window_reads_with_trees_prefix_hits_and_exact_mode(options, read_starts):
    """Gemma 2 (windows of 16, capped scores), a drafter verified every cycle, through token trees, prefix-cache
    hits (the second round's prompts start as the first's: their rest is prefilled from a later position), and
    exact mode, which reads every position."""
    target = _target("gemma2")
    engine = SpecEngine(target, make_drafter(target, block_size=8), kv_page_size=4, draft_policy="fixed", **options)
    exact = bool(options.get("exact"))
    _check(engine, target, PROMPTS, read_starts, skipped=not exact)
    if "prefix_cache_tokens" in options:
        read_starts.clear()
        again = [p + [5, 6, 7] for p in PROMPTS]
        results = _check(engine, target, again, read_starts)
        assert sum(r.stats.cached_tokens for r in results) > 0


def test_reads_from_a_page_equal_the_whole_read_from_there():
    """`PagedKV.read(start=...)`: a view for one row whose pages are consecutive, a gather otherwise (rows whose
    pages interleave), both equal to the whole read cut at the start."""
    kv = PagedKV(1, 2, 2, 4, torch.float32, "cpu", page_size=4, lengths=[0, 0])
    for n in range(1, 7):  # the two rows take pages in turn: neither row's pages are consecutive
        kv.reserve([4 * n, 4 * n])
    kv.keys[0].copy_(torch.randn_like(kv.keys[0]))
    kv.values[0].copy_(torch.randn_like(kv.values[0]))
    for length, start in ((24, 8), (21, 20), (9, 0)):
        whole = kv.read(0, length)
        part = kv.read(0, length, kv.page_index(length, start=start), start)
        assert all(torch.equal(w[:, start:], p) for w, p in zip(whole, part))
        index = kv.page_index(length, torch.tensor([1]), start)  # row 1 of the batch
        assert all(torch.equal(w[1:, start:], p) for w, p in zip(whole, kv.read(0, length, index, start)))
        alone = kv.rows([1])  # row 1 as a cache of its own
        parts = alone.read(0, length, alone.page_index(length, start=start), start)
        assert all(torch.equal(w[1:, start:], p) for w, p in zip(whole, parts))
    single = PagedKV(1, 1, 2, 4, torch.float32, "cpu", page_size=4, lengths=[24])
    single.keys[0].copy_(torch.randn_like(single.keys[0]))
    index = single.page_index(24, start=12)
    assert isinstance(index, int)  # consecutive pages: read as a view
    assert torch.equal(single.read(0, 24, index, 12)[0], single.read(0, 24)[0][:, 12:])


def test_a_sliding_drafter_reads_its_window_only_and_drafts_the_same():
    """A drafter with sliding-window layers (transformers' DFlash assistants slide over 2,048 slots) reads each
    sliding layer's context from the page its window reaches (`DFlashDraftModel._window_starts`): its hidden states
    equal those of the whole read (float64), paged and gathered (`DenseKV`) caches alike, and in an engine its
    drafts, hence every cycle's acceptance, are the same as with whole reads."""
    from flashdraft.model.drafter import DFlashDraftModel

    target = _target("qwen3")
    drafter = make_drafter(target, block_size=8, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    torch.manual_seed(0)
    width = len(drafter.target_layer_ids) * drafter.target_hidden_size
    cache = drafter.new_cache(2, 64, page_size=4)
    positions = torch.arange(40)[None].expand(2, -1)
    drafter.write_context(cache, torch.randn(2, 40, width, dtype=torch.float64), positions,
                          torch.ones(2, 40, dtype=torch.bool))
    embeds = torch.randn(2, 8, drafter.config.hidden_size, dtype=torch.float64)
    block = torch.arange(40, 48)[None].expand(2, -1)
    starts = drafter._window_starts(block, cache)
    assert starts == {None: 0, 8: 32}
    whole = DFlashDraftModel._window_starts
    for read_from in (cache, cache.gather_rows(torch.tensor([1, 0]), 40)):
        ours = drafter.draft(read_from, embeds, block, 40)
        try:
            DFlashDraftModel._window_starts = lambda self, position_ids, cache: {None: 0, 8: 0}
            reference = drafter.draft(read_from, embeds, block, 40)
        finally:
            DFlashDraftModel._window_starts = whole
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    prompts = [p[:40] for p in PROMPTS[:2]]
    runs = []
    for starts_of in (whole, lambda self, position_ids, cache: dict.fromkeys(
            {l.self_attn.sliding_window for l in self.layers} | {None}, 0)):
        DFlashDraftModel._window_starts = starts_of
        try:
            results = SpecEngine(target, drafter, kv_page_size=4, draft_policy="fixed").generate(
                prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        finally:
            DFlashDraftModel._window_starts = whole
        runs.append([(r.token_ids, r.stats.acceptance_lengths) for r in results])
    assert runs[0] == runs[1]
    assert [r[0] for r in runs[0]] == [greedy_reference(target, p, NEW_TOKENS) for p in prompts]
