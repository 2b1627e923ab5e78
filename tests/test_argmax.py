"""`flashdraft.engine.argmax.argmax` picks exactly what torch's argmax picks: ties, NaNs, -inf rows, every float
dtype, non-contiguous views, small and large tensors, and inside a compiled graph; `kth_largest` and
`sort_descending` return torch.topk's k-th value and torch.sort's values on the same cases, `largest_sorted` the
first m of that sort or all of it (also over probabilities: partitioned first without zeros, sorted whole with the
long runs of zeros that slow a partition), `fill_below` what masked_fill does, `argmax_and_gap` the argmax and
torch.topk's top-two gap."""

import pytest
import torch

from flashdraft.engine import argmax as argmax_module
from flashdraft.engine.argmax import (NUMPY_FROM_ELEMENTS, argmax, argmax_and_gap, fill_below, kth_largest,
                                      largest_sorted, sort_descending)


def _cases():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 15, 8192), (4, 16, 8192), (3, 8192), (2, 5, 4099), (8192,), (2, 7)]:
        x = torch.randn(*shape, generator=g)
        yield x
        ties = (x * 2).round() / 2  # many equal values
        ties[..., 5] = ties.max()
        ties[..., 3] = ties.max()  # the first of two maxima wins
        yield ties
        nans = x.clone()
        nans.view(-1)[torch.randint(0, x.numel(), (3,), generator=g)] = float("nan")
        yield nans
        yield torch.full(shape, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_argmax_picks_what_torch_picks(dtype):
    for x in _cases():
        x = x.to(dtype)
        with torch.inference_mode():
            got, want = argmax(x), x.argmax(dim=-1)
        assert got.dtype == torch.long and got.shape == want.shape
        assert torch.equal(got, want)
        if x.dim() == 3:  # a non-contiguous view
            assert torch.equal(argmax(x.transpose(0, 1)), x.transpose(0, 1).argmax(dim=-1))


def test_large_cpu_tensors_go_through_numpy_and_small_ones_do_not(monkeypatch):
    calls = []
    real = argmax_module.np.asarray
    monkeypatch.setattr(argmax_module.np, "asarray", lambda *a, **k: calls.append(1) or real(*a, **k))
    argmax(torch.randn(2, NUMPY_FROM_ELEMENTS))
    assert calls == [1]
    argmax(torch.randn(2, 8))
    assert calls == [1]


def test_argmax_compiles_without_a_graph_break():
    compiled = torch.compile(lambda x: argmax(x * 2), fullgraph=True, backend="eager")
    x = torch.randn(3, 8192)
    assert torch.equal(compiled(x), (x * 2).argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kth_largest_and_sort_descending_are_torchs(dtype):
    for x in _cases():
        x = x.to(dtype)
        views = [x] + ([x.transpose(0, 1)] if x.dim() == 3 else [])
        for view in views:
            with torch.inference_mode():
                sorted_values = sort_descending(view)
                torch.testing.assert_close(sorted_values, view.sort(dim=-1, descending=True).values, rtol=0, atol=0,
                                           equal_nan=True)
                for k in (1, 5, view.shape[-1]):
                    torch.testing.assert_close(kth_largest(view, k), torch.topk(view, k, dim=-1).values[..., -1:],
                                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_largest_sorted_is_the_sorts_first_values(dtype):
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(6, 8192, generator=g) * 3, -1)  # no zeros: partitioned first
    sparse = torch.softmax(torch.randn(6, 8192, generator=g) / 0.02, -1)  # most underflow to 0: sorted whole
    bf16_ties = torch.softmax(torch.randn(6, 8192, generator=g).bfloat16().float(), -1)  # runs of equal values
    if dtype == torch.float32:
        assert largest_sorted(probs, 1024).shape[-1] == 1024 and largest_sorted(sparse, 1024).shape[-1] == 8192
    for x in [*_cases(), probs, sparse, bf16_ties, probs[:, None].expand(6, 3, 8192)]:
        x = x.to(dtype)
        for m in (1, 7, 1024, x.shape[-1], x.shape[-1] + 5):
            got = largest_sorted(x, m)
            assert got.shape[-1] in (min(m, x.shape[-1]), x.shape[-1])  # the m largest, or the whole row sorted
            torch.testing.assert_close(got, x.sort(dim=-1, descending=True).values[..., :got.shape[-1]],
                                       rtol=0, atol=0, equal_nan=True)


def test_fill_below_is_masked_fill():
    g = torch.Generator().manual_seed(4)
    for x in _cases():
        cut = x.nan_to_num(0.0).median(dim=-1, keepdim=True).values
        for c in (cut, torch.full_like(cut, float("-inf")), torch.full_like(cut, float("nan"))):
            for value in (0.0, float("-inf")):
                torch.testing.assert_close(fill_below(x, c, value), x.masked_fill(x < c, value), rtol=0, atol=0,
                                           equal_nan=True)
    x = torch.randn(4, 8192, generator=g)
    assert torch.equal(fill_below(x, x[:, :1], 0.0), x.masked_fill(x < x[:, :1], 0.0))
    probs = torch.softmax(x * 3, -1)  # non-negative: the product form; with a NaN, the general one
    probs[0, :5] = 0.0
    for p in (probs, probs.index_put((torch.tensor([1]), torch.tensor([7])), torch.tensor(float("nan")))):
        cut = p.nan_to_num(0.0).median(dim=-1, keepdim=True).values
        got, want = fill_below(p, cut, 0.0), p.masked_fill(p < cut, 0.0)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
        assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))  # no -0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_and_gap_is_the_argmax_and_the_top_two_gap(dtype):
    for x in _cases():
        if x.isnan().any() or x.isinf().all():
            continue
        x = x.to(dtype)
        before = x.clone()
        ids, gap = argmax_and_gap(x)
        assert torch.equal(ids, x.argmax(dim=-1))
        top = x.float().topk(2, dim=-1).values
        torch.testing.assert_close(gap, top[..., 0] - top[..., 1])  # 0 where the maximum is tied
        assert torch.equal(x, before)  # the caller's rows are not masked
