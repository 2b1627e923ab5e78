"""StaticKV row management: rows leave and join in place while the row count stays (CUDA graphs keep replaying
the same addresses), and by one copy when it changes; the live rows always keep their contents."""

from __future__ import annotations

import torch

from flashdraft.model.slots import StaticKV


def make_kv(rows: int, capacity: int = 8, fill_from: int = 0) -> StaticKV:
    kv = StaticKV(2, rows, capacity, 1, 2, torch.float32, torch.device("cpu"))
    for i, t in enumerate(kv.keys + kv.values):
        for r in range(rows):
            t[r] = fill_from + r + 100 * i  # every row of every tensor is recognisable
    return kv


def row_ids(kv: StaticKV, layer: int = 0, upto: int | None = None) -> list[int]:
    return [int(v) for v in kv.keys[layer][:, 0, 0, 0][:upto]]


def test_select_rows_in_place_when_the_row_count_stays():
    kv = make_kv(4)
    ptrs = [t.data_ptr() for t in kv.keys + kv.values]
    kv.select_rows(torch.tensor([2, 0, 1, 1]))  # a padded batch: row 3 left, row 1 doubles as padding
    assert [t.data_ptr() for t in kv.keys + kv.values] == ptrs
    assert row_ids(kv) == [2, 0, 1, 1] and int(kv.values[1][0, 0, 0, 0]) == 302
    kv.select_rows(torch.tensor([1]))  # fewer rows: a new, smaller tensor
    assert kv.batch == 1 and row_ids(kv) == [0]


def test_join_rows_and_merge_in_place_when_the_row_count_stays():
    kv = make_kv(4)
    ptr = kv.keys[0].data_ptr()
    kv.join_rows(3, 1)
    assert kv.keys[0].data_ptr() == ptr and row_ids(kv, upto=3) == [0, 1, 2]
    other = make_kv(2, capacity=4, fill_from=50)
    kv.merge(other, keep=1, pad=1)  # 1 live + 2 joining + 1 padding = 4 rows: same tensor
    assert kv.keys[0].data_ptr() == ptr and row_ids(kv, upto=3) == [0, 50, 51]
    assert torch.equal(kv.keys[1][1:3, :4], other.keys[1])


def test_merge_copies_once_when_the_row_count_or_capacity_changes():
    kv = make_kv(2)
    kv.merge(make_kv(3, capacity=16, fill_from=50), keep=2, pad=3)
    assert kv.batch == 8 and kv.capacity == 16 and row_ids(kv, upto=5) == [0, 1, 50, 51, 52]
    assert kv.keys[0][5:].abs().sum() == 0  # padding rows start empty
    kv.join_rows(5, 11)
    assert kv.batch == 16 and row_ids(kv, upto=5) == [0, 1, 50, 51, 52]


def test_merge_grows_the_smaller_cache_and_shrink_cuts_slots():
    kv = make_kv(1, capacity=512)
    kv.merge(make_kv(1, capacity=1024, fill_from=50))
    assert kv.batch == 2 and kv.capacity == 1024 and row_ids(kv) == [0, 50]
    kv.shrink(256)
    assert kv.capacity == 256 and row_ids(kv) == [0, 50]
    kv.shrink(512)  # never grows
    assert kv.capacity == 256
