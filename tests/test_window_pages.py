"""Sliding-window layers give back the pages their window has left (`PagedKV.reserve(keep_from=)`; `GroupedKV`:
one page table per window where full and windowed layers mix): a windowed layer's cache holds about window + one
block of positions per row however long the row grows, a full-attention layer's every position, and the output
stays the target's own greedy `generate`, token for token. Pages of 4 positions against windows of 16-24 and rows
of ~100 positions; every way the engine fills and reads the cache: drafted blocks, a drafter under the adaptive
policy, token trees, prefix-cache hits on prompts and on answers (a chat's next turn), compiled steps."""

from __future__ import annotations

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.engine.compiled import compile_unavailable
from flashdraft.model.slots import TRASH_PAGE, GroupedKV, PagedKV, pages_for
from test_window_reads import PROMPTS, _target
from tiny import WINDOWED, OracleProposer, greedy_reference, make_drafter

PAGE, BLOCK, NEW_TOKENS = 4, 8, 60


@pytest.fixture
def held(monkeypatch):
    """After every `PagedKV.reserve` before a cycle (`keep_from` given: a prefill holds its whole prompt until its
    batch takes pages for the first): (the cache's window, the most pages a row owns, the most a row gave back)."""
    seen = []
    reserve = PagedKV.reserve

    def spy(self, lengths, keep_from=None):
        reserve(self, lengths, keep_from)
        if keep_from is not None:
            seen.append((self.window, max(map(len, self.pages), default=0), max(self.dropped, default=0)))

    monkeypatch.setattr(PagedKV, "reserve", spy)
    return seen


def _check_pages(engine, held, longest: int):
    """Windowed caches: at most the window and a block (or tree) in pages per row, some given back; full ones:
    everything."""
    windows, block = set(engine.fast.windows), engine.scratch_slots
    for window in windows - {None}:
        mine = [(n, d) for w, n, d in held if w == window]
        assert max(n for n, _ in mine) <= (window + block) // PAGE + 2, (window, max(mine))
        assert max(d for _, d in mine) > 0, "no page went back"
    if None in windows:
        assert max(n for w, n, _ in held if w is None) >= pages_for(longest, PAGE)


@pytest.mark.parametrize("arch", WINDOWED)
def test_windowed_pages_follow_the_window_and_decode_as_the_target(arch, held):
    target = _target(arch)
    references = [p + greedy_reference(target, p, NEW_TOKENS) for p in PROMPTS]
    engine = SpecEngine(target, block_size=BLOCK, kv_page_size=PAGE, proposer=OracleProposer(references, seed=1))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [p + r.token_ids for p, r in zip(PROMPTS, results)] == references
    _check_pages(engine, held, len(PROMPTS[0]) + NEW_TOKENS)
    assert isinstance(engine.fast.new_cache(1), GroupedKV) == (None in set(engine.fast.windows))


@pytest.mark.parametrize("options", [dict(tree_budget=24), dict(prefix_cache_tokens=512)],
                         ids=["trees", "prefix-cache"])
def test_window_pages_with_a_drafter_trees_and_prefix_hits(options, held):
    """Gemma 3 (sliding and full layers: two page tables) with a drafter under the adaptive policy, through token
    trees, and prefix-cache hits: the second round's prompts are the first round's whole conversations plus a
    turn, so their hits reach into pages an answer filled while its windowed layers were giving pages back."""
    target = _target("gemma3")
    engine = SpecEngine(target, make_drafter(target, block_size=BLOCK), kv_page_size=PAGE, **options)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == [greedy_reference(target, p, NEW_TOKENS) for p in PROMPTS]
    _check_pages(engine, held, len(PROMPTS[0]) + NEW_TOKENS)
    if "prefix_cache_tokens" in options:
        again = [p + r.token_ids + [5, 6, 7] for p, r in zip(PROMPTS, results)]
        results = engine.generate(again, params)
        assert [r.token_ids for r in results] == [greedy_reference(target, p, NEW_TOKENS) for p in again]
        assert min(r.stats.cached_tokens for r in results) > len(PROMPTS[-1]) + 16  # into the answers' pages


@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                    reason=str(compile_unavailable(torch.device("cpu"))))
def test_compiled_steps_read_given_back_pages_only_where_masked(held):
    """Compiled steps read every position from 0 (static shapes): a windowed layer's given-back columns read the
    trash page, which its window masks; the output is still the target's."""
    target = _target("gemma3")
    prompts = PROMPTS[:2]
    references = [p + greedy_reference(target, p, 32) for p in prompts]
    engine = SpecEngine(target, block_size=BLOCK, kv_page_size=PAGE, proposer=OracleProposer(references, seed=2),
                        compile=True)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=32))
    assert [p + r.token_ids for p, r in zip(prompts, results)] == references
    _check_pages(engine, held, len(prompts[0]) + 32)


def test_reserve_gives_back_what_left_the_window():
    """`reserve(keep_from=)`: pages wholly before keep_from - window + 1 go back to the free list, their table
    columns point to the trash page, reads of the rest are unchanged; rows leaving, joining and merging keep
    which columns they gave back; `page_of` refuses a column that went back."""
    kv = PagedKV(1, 2, 1, 2, torch.float32, "cpu", page_size=PAGE, lengths=[24, 16], window=6)
    kv.keys[0].copy_(torch.randn_like(kv.keys[0]))
    before = kv.read(0, 24)[0].clone()
    assert kv.pool_pages == 11
    kv.reserve([28, 20], keep_from=[20, 9])  # row 0 needs 15.., row 1 needs 4..: 3 pages and 1 page go
    assert kv.dropped == [3, 1] and [len(p) for p in kv.pages] == [4, 4]
    assert kv.pool_pages == 1 + 8 and not kv.free  # 4 of 11 free: compacted, then grown by the 2 new pages
    assert kv.table[0, :3].tolist() == [TRASH_PAGE] * 3 and kv.table[1, 0] == TRASH_PAGE
    after = kv.read(0, 24)[0]
    assert torch.equal(after[0, 12:], before[0, 12:]) and torch.equal(after[1, 4:16], before[1, 4:16])
    with pytest.raises(IndexError):
        kv.page_of(0, 2)
    assert kv.page_of(0, 3) == kv.pages[0][0]
    kv.reserve([28, 20], keep_from=[20, 9])  # nothing more to give back
    assert kv.dropped == [3, 1]
    kv.select_rows(torch.tensor([1, 0, 0]))  # a padding row selected twice: empty
    assert kv.dropped == [1, 3, 0] and kv.pages[2] == []
    kv.join_rows(2, 1)
    other = PagedKV(1, 1, 1, 2, torch.float32, "cpu", page_size=PAGE, lengths=[12], window=6)
    other.reserve([12], keep_from=[10])
    kv.merge(other, keep=2)
    assert kv.dropped == [1, 3, 1] and kv.table[2, 0] == TRASH_PAGE and kv.table[2, 1] == kv.pages[2][0]
    full = PagedKV(1, 1, 1, 2, torch.float32, "cpu", page_size=PAGE, lengths=[24])
    full.reserve([28], keep_from=[20])  # no window: everything stays
    assert full.dropped == [0] and len(full.pages[0]) == 7


def test_grouped_cache_writes_and_reads_each_layer_through_its_window_table():
    """A `GroupedKV` stores every layer's keys as one cache would and reads them back by layer, each group through
    its own table; its windowed group gives pages back, its full group keeps them."""
    windows = [4, None, 4]
    grouped = GroupedKV(windows, 2, 1, 2, torch.float32, "cpu", page_size=PAGE, lengths=[16, 12])
    flat = PagedKV(3, 2, 1, 2, torch.float32, "cpu", page_size=PAGE, lengths=[16, 12])
    positions = torch.arange(12)[None].expand(2, -1)
    for kv in (grouped, flat):
        slots = kv.slots(positions)
        for layer in range(3):
            torch.manual_seed(layer)
            kv.write(layer, slots, torch.randn(2, 12, 1, 2), torch.randn(2, 12, 1, 2))
    for layer, window in enumerate(windows):
        index = grouped.page_index(12, start=4, window=window)
        assert all(torch.equal(a, b[:, 4:]) for a, b in zip(grouped.read(layer, 12, index, 4), flat.read(layer, 12)))
    grouped.reserve([16, 16], keep_from=[12, 12])
    windowed, full = grouped.groups
    assert windowed.dropped == [2, 2] and full.dropped == [0, 0]
    assert grouped.held_pages == windowed.held_pages + full.held_pages == 2 * 2 + 2 * 4
    assert [(g.window, layers) for g, layers in grouped.layer_groups()] == [(4, [0, 2]), (None, [1])]
    dense = grouped.gather_rows(torch.tensor([1]), 12)
    assert torch.equal(dense.keys[1], flat.read(1, 12)[0][1:])


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], ["sliding_attention"] * 2],
                         ids=["mixed", "all-sliding"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_a_sliding_drafter_gives_back_its_pages_and_drafts_the_same(layer_types, policy, held, monkeypatch):
    """A drafter with sliding layers (z-lab's newer drafters slide in 4-5 of 5 layers, to bound their cache) keeps
    only the context pages its window reaches from a row's committed length on (`Batch.grow`), though a row's
    pending context (written when it drafts) may start further back (a window shorter than a block here): what
    lands in the trash page no query would have read. With every cycle drafting, every draft's hidden states (float64)
    and every cycle's acceptance are those of a drafter keeping every position (the cache before, restored by
    patching); under the adaptive policy (which drafts by measured timings: not the same cycles twice) the output
    is still the target's."""
    from flashdraft.model import drafter as drafter_module

    WINDOW = 5  # less than a block: a row's pending context reaches behind its window

    target = _target("qwen3")
    drafter = make_drafter(target, block_size=BLOCK, layer_types=layer_types, sliding_window=WINDOW)
    runs, hidden, draft = [], [], drafter.draft

    def recorded(*args, **kwargs):
        hidden[-1].append(draft(*args, **kwargs))
        return hidden[-1][-1]

    monkeypatch.setattr(drafter, "draft", recorded)
    for keep_all in (False, True):
        if keep_all:
            monkeypatch.setattr(drafter_module, "new_paged_cache",
                                lambda windows, *args, **kwargs: PagedKV(len(windows), *args, **kwargs))
        held.clear()
        hidden.append([])
        results = SpecEngine(target, drafter, kv_page_size=PAGE, draft_policy=policy).generate(
            PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
        runs.append([(r.token_ids, r.stats.acceptance_lengths) for r in results])
        sliding = [(n, d) for w, n, d in held if w == WINDOW]
        assert bool(sliding) != keep_all
        if sliding:
            assert max(d for _, d in sliding) > 0 and max(n for n, _ in sliding) < pages_for(60, PAGE)
    if policy == "fixed":
        assert runs[0] == runs[1] and len(hidden[0]) == len(hidden[1]) > 10
        for ours, reference in zip(*hidden):
            torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-9)
    assert [r[0] for r in runs[0]] == [greedy_reference(target, p, NEW_TOKENS) for p in PROMPTS]


def test_a_group_short_of_budget_makes_the_others_let_free_pages_go():
    """Under a budget (`max_pages` pages of every layer, the server's --kv-cache-memory), a group whose rows need a
    page when the pools together fill the budget first compacts the other groups (their free pages: here the sliding
    group's, below the size where compaction happens by itself), then grows by what its rows need."""
    kv = GroupedKV([4, None], 1, 1, 2, torch.float32, "cpu", page_size=PAGE, lengths=[24], max_pages=7)
    windowed, full = kv.groups
    assert windowed.pool_pages == full.pool_pages == 7
    kv.reserve([28], keep_from=[24])  # the sliding group gives back 5 of its 6 pages and takes one of them again
    assert windowed.held_pages == 2 and windowed.pool_pages == 3  # compacted: the full group needed room
    assert full.held_pages == 7 and full.pool_pages == 8
