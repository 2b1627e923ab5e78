"""Unit tests of the training pieces against brute-force references: anchors, blocks, masks, loss, config."""

import math

import pytest
import torch

from flashdraft.model.drafter import DFlashDraftModel, make_draft_config
from flashdraft.train.anchors import anchor_generator, build_blocks, candidate_anchors, pad_anchors, sample_anchors
from flashdraft.train.loss import default_gamma, dflash_loss, gather_teacher_logits, position_weights, slot_weights
from flashdraft.train.masks import dense_training_mask, flex_supported, flex_training_mask
from flashdraft.train.synthetic import tiny_target_config
from flashdraft.train.trainer import resolve_mask_token_id

torch.set_num_threads(1)


def _random_case(seed, b=3, t_max=30, block=4):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(block, t_max + 1, (1,), generator=g)) for _ in range(b)]
    ids = torch.zeros(b, t_max, dtype=torch.long)
    loss_mask = torch.zeros(b, t_max, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 60, (n,), generator=g)
        p = int(torch.randint(1, n, (1,), generator=g))
        loss_mask[i, p:n] = True
        # a hole inside the response (e.g. a tool output not to be learned) exercises label validity
        if n - p > 6:
            loss_mask[i, p + 3] = False
    return ids, loss_mask, lengths


@pytest.mark.parametrize("seed", range(5))
def test_anchor_candidates_and_sampling_vs_brute_force(seed):
    block = 4
    ids, loss_mask, lengths = _random_case(seed, block=block)
    for i, n in enumerate(lengths):
        brute = [p for p in range(ids.shape[1]) if loss_mask[i, p] and p + block - 1 <= n - 1]
        assert candidate_anchors(loss_mask[i], block, n).tolist() == brute
        for num in (1, 3, 1000):
            a = sample_anchors(loss_mask[i], block, num, anchor_generator(7, 0, i), n).tolist()
            assert len(a) == min(num, len(brute)) and len(set(a)) == len(a) and a == sorted(a)
            assert set(a) <= set(brute)
        same = sample_anchors(loss_mask[i], block, 3, anchor_generator(7, 0, i), n)
        assert same.tolist() == sample_anchors(loss_mask[i], block, 3, anchor_generator(7, 0, i), n).tolist()


def test_anchors_resampled_per_epoch_and_uniform():
    mask = torch.zeros(64, dtype=torch.bool)
    mask[10:] = True
    cand = candidate_anchors(mask, 16).tolist()
    assert cand == list(range(10, 64 - 15))
    epochs = [tuple(sample_anchors(mask, 16, 5, anchor_generator(0, e, 3)).tolist()) for e in range(4)]
    assert len(set(epochs)) == 4, "anchors must be resampled every epoch"
    counts = torch.zeros(64)
    for e in range(2000):
        counts[sample_anchors(mask, 16, 5, anchor_generator(1, e, 0))] += 1
    sel = counts[cand]
    expected = 2000 * 5 / len(cand)
    assert (sel - expected).abs().max() < 0.25 * expected, sel


def test_start_anchors_take_every_answers_first_blocks_and_draw_the_rest_uniformly():
    """Two answers (a chat's two turns): with start_anchors=3 the first three candidates of each are always
    anchors, the other slots uniform over the remaining candidates; 0 keeps the plain uniform draw unchanged."""
    mask = torch.zeros(80, dtype=torch.bool)
    mask[10:30] = True
    mask[40:80] = True
    cand = candidate_anchors(mask, 4).tolist()
    first = [10, 11, 12, 40, 41, 42]
    counts = torch.zeros(80)
    for e in range(3000):
        a = sample_anchors(mask, 4, 10, anchor_generator(2, e, 0), start_anchors=3).tolist()
        assert len(a) == 10 == len(set(a)) and a == sorted(a) and set(first) <= set(a) <= set(cand)
        counts[a] += 1
    rest = [p for p in cand if p not in first]
    expected = 3000 * 4 / len(rest)  # 235 draws each, sd ~15: a bias of a quarter is ~4 sd
    assert (counts[rest] - expected).abs().max() < 0.25 * expected
    assert sample_anchors(mask, 4, 4, anchor_generator(2, 0, 0), start_anchors=3).tolist() == first[:4]
    for e in range(5):
        assert (sample_anchors(mask, 4, 10, anchor_generator(3, e, 1), start_anchors=0).tolist()
                == sample_anchors(mask, 4, 10, anchor_generator(3, e, 1)).tolist())


@pytest.mark.parametrize("seed", range(4))
def test_build_blocks_vs_brute_force(seed):
    block, mask_id = 4, 2
    ids, loss_mask, lengths = _random_case(seed, block=block)
    anchors = [sample_anchors(loss_mask[i], block, 5, anchor_generator(0, 0, i), n) for i, n in enumerate(lengths)]
    a, av = pad_anchors(anchors)
    bb = build_blocks(ids, loss_mask, a, av, block, mask_id)
    b, n = a.shape
    for i in range(b):
        for j in range(n):
            for k in range(block):
                q = j * block + k
                real = j < len(anchors[i])
                anc = int(anchors[i][j]) if real else 0
                assert bb.position_ids[i, q] == anc + k
                assert bb.block_offset[i, q] == k
                assert bb.block_ids[i, q] == (ids[i, anc] if k == 0 else mask_id)
                valid = real and k >= 1 and bool(loss_mask[i, anc + k])
                assert bool(bb.label_valid[i, q]) == valid
                if valid:
                    assert bb.labels[i, q] == ids[i, anc + k]


def _brute_mask(anchors, anchor_valid, ctx_valid, block, causal=False, window=None):
    b, n = anchors.shape
    t = ctx_valid.shape[1]
    q = n * block
    out = torch.zeros(b, 1, q, t + q, dtype=torch.bool)
    for i in range(b):
        for qi in range(q):
            j, k = divmod(qi, block)
            anc = int(anchors[i, j])
            for c in range(t):
                ok = c < anc and bool(ctx_valid[i, c])
                if window is not None:
                    ok = ok and (anc + k - c) < window
                out[i, 0, qi, c] = ok
            for kj in range(q):
                j2, k2 = divmod(kj, block)
                ok = j2 == j and (not causal or k2 <= k)
                if window is not None:
                    ok = ok and abs(k - k2) < window
                out[i, 0, qi, t + kj] = ok
    return out


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 5)])
@pytest.mark.parametrize("seed", range(3))
def test_dense_mask_vs_brute_force(seed, causal, window):
    block = 4
    ids, loss_mask, lengths = _random_case(seed, block=block, t_max=14)
    anchors = [sample_anchors(loss_mask[i], block, 3, anchor_generator(0, 0, i), n) for i, n in enumerate(lengths)]
    a, av = pad_anchors(anchors)
    ctx_valid = torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]
    got = dense_training_mask(a, ctx_valid, block, causal, window)
    want = _brute_mask(a, av, ctx_valid, block, causal, window)
    assert torch.equal(got, want)
    assert got.any(-1).all(), "every query must see at least its own slot"


@pytest.mark.skipif(not flex_supported("cpu", need_backward=False), reason="FlexAttention unavailable")
@pytest.mark.parametrize("causal", [False, True])
def test_flex_mask_predicate_equals_dense(causal):
    block = 4
    ids, loss_mask, lengths = _random_case(3, block=block, t_max=20)
    anchors = [sample_anchors(loss_mask[i], block, 4, anchor_generator(0, 0, i), n) for i, n in enumerate(lengths)]
    a, _ = pad_anchors(anchors)
    ctx_valid = torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]
    dense = dense_training_mask(a, ctx_valid, block, causal)
    bm = flex_training_mask(a, ctx_valid, block, causal)
    b, _, q, kv = dense.shape
    bi = torch.arange(b)[:, None, None]
    qi = torch.arange(q)[None, :, None]
    ki = torch.arange(kv)[None, None, :]
    got = bm.mask_mod(bi, torch.zeros_like(bi), qi, ki)
    assert torch.equal(got, dense[:, 0])


def _tiny_drafter(block=4, layers=2):
    tcfg = tiny_target_config(vocab_size=64, hidden_size=32, num_layers=4, heads=4, kv_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    d = DFlashDraftModel(make_draft_config(tcfg, num_layers=layers, block_size=block, mask_token_id=2))
    emb = torch.randn(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    return d, emb, head


def _loss_with(kind, d, emb, head, ids, loss_mask, lengths, block):
    anchors = [sample_anchors(loss_mask[i], block, 4, anchor_generator(0, 0, i), n) for i, n in enumerate(lengths)]
    a, av = pad_anchors(anchors)
    bb = build_blocks(ids, loss_mask, a, av, block, 2)
    ctx_valid = torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]
    feats = torch.randn(ids.shape[0], ids.shape[1], len(d.target_layer_ids) * 32, generator=torch.Generator().manual_seed(1))
    mask = dense_training_mask(a, ctx_valid, block) if kind == "sdpa" else flex_training_mask(a, ctx_valid, block)
    ctx_pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    hidden = d(d.embed(bb.block_ids, emb), bb.position_ids, feats, ctx_pos, ctx_valid, mask)
    w = slot_weights(bb.block_offset, bb.label_valid, block, None)
    return dflash_loss(hidden, lambda h: d.compute_logits(h, head), bb.labels, w, bb.block_offset, block).loss


@pytest.mark.skipif(not flex_supported("cpu", need_backward=False), reason="FlexAttention unavailable")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_and_sdpa_give_the_same_loss():
    block = 4
    d, emb, head = _tiny_drafter(block)
    ids, loss_mask, lengths = _random_case(2, block=block, t_max=24)
    with torch.no_grad():  # CPU FlexAttention has no backward
        l_sdpa = _loss_with("sdpa", d, emb, head, ids, loss_mask, lengths, block)
        l_flex = _loss_with("flex", d, emb, head, ids, loss_mask, lengths, block)
    assert torch.allclose(l_sdpa, l_flex, atol=1e-5), (l_sdpa, l_flex)


def test_training_pass_matches_per_block_inference_pass():
    """All blocks in one pass with the sparse mask == each block alone with its context (the inference layout)."""
    block = 4
    d, emb, head = _tiny_drafter(block)
    d.eval()
    ids, loss_mask, lengths = _random_case(1, b=1, block=block, t_max=24)
    n = lengths[0]
    anchors = sample_anchors(loss_mask[0], block, 4, anchor_generator(0, 0, 0), n)
    a, av = pad_anchors([anchors])
    bb = build_blocks(ids, loss_mask, a, av, block, 2)
    feats = torch.randn(1, ids.shape[1], len(d.target_layer_ids) * 32)
    ctx_valid = torch.arange(ids.shape[1])[None] < n
    ctx_pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        full = d(d.embed(bb.block_ids, emb), bb.position_ids, feats, ctx_pos, ctx_valid,
                 dense_training_mask(a, ctx_valid, block))
        for j, anc in enumerate(anchors.tolist()):
            sl = slice(j * block, (j + 1) * block)
            one = d(d.embed(bb.block_ids[:, sl], emb), bb.position_ids[:, sl], feats[:, :anc], ctx_pos[:, :anc])
            assert torch.allclose(full[:, sl], one, atol=1e-5), j


def test_loss_weights_and_normalisation():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert default_gamma(4) >= 1
    w = position_weights(16)
    assert w[0] == 0 and math.isclose(float(w[1]), 1.0) and math.isclose(float(w[8]), math.exp(-1.0), rel_tol=1e-6)
    g = torch.Generator().manual_seed(0)
    b, q, h, v, block = 2, 8, 6, 11, 4
    hidden = torch.randn(b, q, h, generator=g, requires_grad=True)
    head = torch.nn.Linear(h, v, bias=False)
    labels = torch.randint(v, (b, q), generator=g)
    offset = torch.arange(block).repeat(q // block)[None].expand(b, q)
    valid = torch.rand(b, q, generator=g) > 0.3
    weights = slot_weights(offset, valid, block, 2.0)
    out = dflash_loss(hidden, head, labels, weights, offset, block)
    ce = torch.nn.functional.cross_entropy(head(hidden).reshape(-1, v), labels.reshape(-1), reduction="none")
    want = (ce * weights.reshape(-1)).sum() / weights.sum()
    assert torch.allclose(out.loss, want, atol=1e-6)
    (g1,) = torch.autograd.grad(out.loss, hidden)
    chunked = dflash_loss(hidden, head, labels, weights, offset, block, chunk_size=3)
    (g2,) = torch.autograd.grad(chunked.loss, hidden)
    assert torch.allclose(out.loss, chunked.loss, atol=1e-6) and torch.allclose(g1, g2, atol=1e-6)
    # distillation against a teacher equal to the draft: KL 0, so the loss is (1 - alpha) * ce
    teacher = head(hidden).detach()
    dist = dflash_loss(hidden, head, labels, weights, offset, block, teacher_logits=teacher, distill_weight=0.5)
    assert torch.allclose(dist.loss, 0.5 * want, atol=1e-5)


def test_teacher_logits_are_shifted_by_one():
    t = torch.arange(5).float()[None, :, None].expand(1, 5, 3)  # logits value = position
    pos = torch.tensor([[2, 3, 4]])
    assert gather_teacher_logits(t, pos)[0, :, 0].tolist() == [1.0, 2.0, 3.0]


def test_mask_token_resolution():
    class Tok:
        mask_token_id = 7

    assert resolve_mask_token_id(None, Tok(), 64) == 7
    assert resolve_mask_token_id(3, None, 64) == 3
    with pytest.raises(ValueError, match="mask-token-id"):
        resolve_mask_token_id(None, None, 64)
    with pytest.raises(ValueError, match="outside"):
        resolve_mask_token_id(64, None, 64)
