"""PagedKV: each row owns pages for its own positions, reads give back exactly what was written, rows leave and
join keeping the others' contents, padding rows and invalid writes never touch a live row, and the pool follows
the pages held (grown by an eighth, compacted when a quarter is free)."""

from __future__ import annotations

import torch

from flashdraft.model.slots import TABLE_POSITIONS, TRASH_PAGE, PagedKV

PAGE = 4


def make_kv(lengths: list[int], rows: int | None = None) -> PagedKV:
    return PagedKV(2, rows or len(lengths), 1, 2, torch.float32, torch.device("cpu"), PAGE, lengths)


def fill(kv: PagedKV, row: int, length: int, base: float, rows: torch.Tensor | None = None) -> None:
    """Write value base + position (keys) and -(base + position) (values) at positions [0, length) of `row`."""
    positions = torch.arange(length)[None]
    rows = torch.tensor([row]) if rows is None else rows
    slots = kv.slots(positions, rows)
    for layer in range(2):
        k = (base + positions.float())[..., None, None].expand(1, length, 1, 2) + 1000 * layer
        kv.write(layer, slots, k, -k)


def row_values(kv: PagedKV, row: int, length: int, layer: int = 0) -> list[float]:
    keys, values = kv.read(layer, length, kv.page_index(length, torch.tensor([row])))
    assert torch.equal(values, -keys)
    return keys[0, :, 0, 0].tolist()


def test_rows_own_pages_for_their_own_lengths_and_read_back_what_was_written():
    kv = make_kv([30, 3, 9])
    assert [len(p) for p in kv.pages] == [8, 1, 3] and kv.held_pages == 12
    assert kv.pool_pages == 13  # the pages held and the trash page: no row pays for the longest one
    for r, n in enumerate((30, 3, 9)):
        fill(kv, r, n, 100 * r)
    for r, n in enumerate((30, 3, 9)):
        assert row_values(kv, r, n) == [100 * r + p for p in range(n)]
    assert row_values(kv, 1, 3, layer=1) == [1100 + p for p in range(3)]


def test_invalid_writes_and_unowned_positions_go_to_the_trash_page():
    kv = make_kv([8, 8])
    fill(kv, 0, 8, 0)
    fill(kv, 1, 8, 50)
    slots = kv.slots(torch.tensor([[2, 3]]), torch.tensor([0]), valid=torch.tensor([[False, True]]))
    assert int(slots[0, 0]) // PAGE == TRASH_PAGE
    kv.write(0, slots, torch.full((1, 2, 1, 2), -7.0), torch.full((1, 2, 1, 2), 7.0))
    keys, _ = kv.read(0, 8, kv.page_index(8, torch.tensor([0])))
    assert keys[0, :, 0, 0].tolist() == [0, 1, 2, -7, 4, 5, 6, 7]  # position 2 (invalid) untouched
    assert row_values(kv, 1, 8) == [50 + p for p in range(8)]


def test_one_row_with_consecutive_pages_is_read_as_a_view():
    kv = make_kv([10])
    fill(kv, 0, 10, 0)
    index = kv.page_index(10)
    assert isinstance(index, int)
    keys, _ = kv.read(0, 10, index)
    assert keys.data_ptr() == kv.keys[0].data_ptr() + index * PAGE * 2 * 4
    gathered, _ = kv.read(0, 10, kv.table[:1, :3])  # the same pages gathered (a copy)
    assert torch.equal(keys, gathered)
    wider = make_kv([10, 4])  # one row picked out of a batch is a view too
    assert isinstance(wider.page_index(10, torch.tensor([0])), int)
    assert not isinstance(wider.page_index(10, torch.tensor([0, 1])), int)


def test_rows_leave_their_pages_and_a_repeated_row_is_an_empty_padding_row():
    kv = make_kv([12, 4, 8, 4])
    for r, n in enumerate((12, 4, 8, 4)):
        fill(kv, r, n, 100 * r)
    table_ptr = kv.table.data_ptr()
    pool_ptrs = [t.data_ptr() for t in kv.keys + kv.values]
    kv.select_rows(torch.tensor([2, 0, 1, 1]))  # row 3 left; row 1 repeated as padding of a 4-row bucket
    assert kv.table.data_ptr() == table_ptr and [t.data_ptr() for t in kv.keys + kv.values] == pool_ptrs
    assert [len(p) for p in kv.pages] == [2, 3, 1, 0] and kv.held_pages == 6 and len(kv.free) == 1
    fill(kv, 3, 4, -1, rows=torch.tensor([3]))  # what the padding row writes lands in the trash page
    assert row_values(kv, 0, 8) == [200 + p for p in range(8)]
    assert row_values(kv, 1, 12) == [p for p in range(12)]
    assert row_values(kv, 2, 4) == [100 + p for p in range(4)]


def test_merge_copies_the_newcomers_pages_and_join_rows_adds_empty_rows():
    kv = make_kv([8, 4])
    fill(kv, 0, 8, 0)
    fill(kv, 1, 4, 10)
    other = make_kv([4, 12])
    fill(other, 0, 4, 500)
    fill(other, 1, 12, 600)
    kv.merge(other, keep=1, pad=1)  # row 1 leaves; other's two rows and one padding row join
    assert [len(p) for p in kv.pages] == [2, 1, 3, 0]
    assert row_values(kv, 0, 8) == list(range(8))
    assert row_values(kv, 1, 4) == [500 + p for p in range(4)]
    assert row_values(kv, 2, 12) == [600 + p for p in range(12)]
    kv.join_rows(2, 3)
    assert [len(p) for p in kv.pages] == [2, 1, 0, 0, 0] and kv.batch == 5
    assert row_values(kv, 1, 4) == [500 + p for p in range(4)]


def test_the_pool_grows_by_an_eighth_and_is_compacted_when_a_quarter_is_free():
    kv = make_kv([4] * 16)
    for r in range(16):
        fill(kv, r, 4, 10 * r)
    assert kv.pool_pages == 17
    kv.reserve([8] + [4] * 15)  # one page more: the pool grows by an eighth, not by one page
    assert kv.pool_pages == 17 + 2 and len(kv.free) == 1
    kv.reserve([4 * 8] + [4] * 15)  # more than an eighth is missing: exactly what is missing
    assert kv.pool_pages == 19 + 5 and not kv.free
    assert kv.capacity == TABLE_POSITIONS  # the table addresses whole chunks of positions per row
    kv.select_rows(torch.tensor([0, 5, 9]))  # 13 rows leave: 13 of 24 pages free, the pool is compacted
    assert kv.held_pages == 10 and kv.pool_pages == 11 and not kv.free
    assert row_values(kv, 1, 4) == [50 + p for p in range(4)]
    assert row_values(kv, 2, 4) == [90 + p for p in range(4)]
    assert row_values(kv, 0, 4) == list(range(4))


def test_move_slots_copies_a_path_within_each_row():
    kv = make_kv([8, 8])
    fill(kv, 0, 8, 0)
    fill(kv, 1, 8, 100)
    kv.move_slots(torch.tensor([0, 1]), torch.tensor([[5, 7], [6, 4]]), torch.tensor([[2, 3], [2, 3]]))
    assert row_values(kv, 0, 8) == [0, 1, 5, 7, 4, 5, 6, 7]
    assert row_values(kv, 1, 8) == [100, 101, 106, 104, 104, 105, 106, 107]


def test_a_budget_stops_the_eighth_but_never_a_page_a_row_needs():
    kv = PagedKV(2, 16, 1, 2, torch.float32, torch.device("cpu"), PAGE, [4] * 16, max_pages=18)
    kv.reserve([8] + [4] * 15)  # an eighth would be 2 pages; the budget leaves room for 1
    assert kv.pool_pages == 18 and not kv.free
    kv.reserve([12] + [4] * 15)  # past the budget only by what a row needs (the scheduler keeps rows within it)
    assert kv.pool_pages == 19


def test_prefill_runs_prompts_of_similar_length_together_and_matches_each_prompt_alone():
    """One long prompt among short ones is prefilled in its own forward (the short ones are not padded to its
    length), and every row's last logits, features and cache equal what the row computes alone."""
    from tiny import cache_row, make_target

    from flashdraft.model.fast_target import FastTarget, length_groups
    from flashdraft.model.target import TargetModel

    assert length_groups([1300, 64, 64, 64]) == [[0, 1], [2, 3]]
    assert length_groups([10, 12, 9]) == [[1, 0, 2]]
    fast = FastTarget(TargetModel(make_target("qwen3"), layer_ids=[0, 1]))
    lengths = [5, 40, 6, 38]
    ids = torch.zeros(4, 40, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.arange(n) * (r + 3) % 90 + 1
    positions = torch.arange(40)[None].expand(4, -1)
    kv = fast.new_cache(4, lengths, page_size=8)
    logits, features = fast.prefill(ids, positions, kv, torch.tensor(lengths), capture=True)
    for r, n in enumerate(lengths):
        alone = fast.new_cache(1, n, page_size=8)
        want_logits, want_features = fast.forward(ids[r:r + 1, :n], positions[r:r + 1, :n], alone,
                                                  logit_index=torch.tensor([n - 1]), capture=True, key_len=n)
        torch.testing.assert_close(logits[r], want_logits[0], atol=1e-4, rtol=1e-4)
        assert features[r].shape[0] == n  # the row's own positions only
        torch.testing.assert_close(features[r], want_features[0], atol=1e-4, rtol=1e-4)
        for mine, theirs in zip(cache_row(kv, r, n), cache_row(alone, 0, n), strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
