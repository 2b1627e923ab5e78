"""Sequence packing: several examples per row with masks kept exact. The target's features of a packed example equal
its features alone, and one training step over packed rows gives the loss, gradient norm and gradients of the same
examples unpacked (tiny float32 models)."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from flashdraft.model.target import TargetModel
from flashdraft.train.data import Example
from flashdraft.train.anchors import pad_anchors
from flashdraft.train.features import target_features
from flashdraft.train.masks import dense_training_mask, flex_supported, flex_training_mask
from flashdraft.train.packing import pack_batch, pack_rows
from flashdraft.train.synthetic import BOS, MASK, progression, tiny_target_config
from flashdraft.train.trainer import TrainConfig, Trainer

torch.set_num_threads(1)


def _target():
    torch.manual_seed(0)
    cfg = tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1, num_layers=4)
    return Qwen3ForCausalLM(cfg).eval()


def _examples(n=12):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(14, 31, (1,), generator=g))
        prompt = int(torch.randint(2, 6, (1,), generator=g))
        ids = [BOS] + progression(i * 5, 1 + i % 3, length - 1, 60)
        out.append(Example(torch.tensor(ids), torch.tensor([False] * prompt + [True] * (length - prompt))))
    return out


def test_pack_rows_groups_in_order_and_refuses_too_long():
    assert pack_rows([5, 4, 3, 8, 1], 9) == [[0, 1], [2], [3, 4]]
    with pytest.raises(ValueError, match="example 1 has 10 tokens"):
        pack_rows([3, 10], 9)


def test_packed_target_features_equal_each_example_alone():
    target = TargetModel(_target(), [1, 3])
    exs = [e.input_ids for e in _examples(5)]
    packed = pack_batch([exs[:3], exs[3:]])
    feats, logits, valid = target_features(target, None, keep_logits=True, packed=packed)
    assert torch.equal(valid, packed.valid)
    for r, row in enumerate([exs[:3], exs[3:]]):
        for seq, start in zip(row, packed.offsets[r]):
            alone, alone_logits, _ = target_features(target, [seq], keep_logits=True)
            n = seq.numel()
            assert torch.allclose(feats[r, start:start + n], alone[0], atol=1e-5)
            assert torch.allclose(logits[r, start:start + n], alone_logits[0], atol=1e-5)
    assert (feats[~valid] == 0).all()


@pytest.mark.parametrize("distill_weight", [0.0, 0.5])
def test_packed_step_equals_unpacked(tmp_path, distill_weight):
    exs = _examples()
    rows = pack_rows([len(e) for e in exs], 96)
    assert 1 < len(rows) < len(exs) and max(map(len, rows)) >= 3  # several examples per row, several rows

    def one_step(pack: bool, batch_size: int):
        cfg = TrainConfig(output_dir=str(tmp_path / f"pack{pack}"), block_size=4, num_draft_layers=1,
                          mask_token_id=MASK, num_anchors=5, lr=1e-3, max_length=96, batch_size=batch_size,
                          max_steps=1, progress=False, eval_at_start=False, seed=3, pack_sequences=pack,
                          distill_weight=distill_weight)
        trainer = Trainer(cfg, target_model=_target(), examples=exs)
        grads = {}
        step = trainer.scheduler.step

        def record(*args, **kwargs):  # after the optimizer step, before the gradients are zeroed
            grads.update({n: p.grad.clone() for n, p in trainer.drafter.named_parameters() if p.grad is not None})
            return step(*args, **kwargs)

        trainer.scheduler.step = record
        rec = trainer.train_step(0)
        return trainer, rec, grads

    packed, rec_p, grads_p = one_step(True, len(rows))
    assert packed.rows == rows
    plain, rec_u, grads_u = one_step(False, len(exs))
    assert sorted(rec_p["samples"]) == sorted(rec_u["samples"]) == list(range(len(exs)))
    assert rec_p["label_weight"] == rec_u["label_weight"]  # the same blocks and labels
    assert abs(rec_p["loss"] - rec_u["loss"]) < 1e-5, (rec_p["loss"], rec_u["loss"])
    assert abs(rec_p["grad_norm"] - rec_u["grad_norm"]) < 1e-5 * max(1.0, rec_u["grad_norm"])
    assert grads_p.keys() == grads_u.keys() and grads_p
    for name in grads_u:
        assert torch.allclose(grads_p[name], grads_u[name], atol=1e-6, rtol=1e-4), \
            (name, (grads_p[name] - grads_u[name]).abs().max())


@pytest.mark.skipif(not flex_supported("cpu", need_backward=False), reason="FlexAttention unavailable")
@pytest.mark.parametrize("window", [None, 5])
def test_flex_mask_with_segments_equals_dense(window):
    """The sparse FlexAttention mask (the CUDA training path) applies the same packed-row predicate as the dense one."""
    exs = _examples(5)
    packed = pack_batch([[e.input_ids for e in exs[:3]], [e.input_ids for e in exs[3:]]])
    anchors, _ = pad_anchors([torch.tensor([2, 9, 20, 31, 44]), torch.tensor([1, 15, 33])])
    for causal in (False, True):
        dense = dense_training_mask(anchors, packed.valid, 4, causal, window, packed.segments)
        bm = flex_training_mask(anchors, packed.valid, 4, causal, window, segments=packed.segments)
        b, _, q, kv = dense.shape
        bi, qi, ki = torch.arange(b)[:, None, None], torch.arange(q)[None, :, None], torch.arange(kv)[None, None, :]
        assert torch.equal(bm.mask_mod(bi, torch.zeros_like(bi), qi, ki), dense[:, 0])
    # and the segments matter: a block never sees context of the example before it in its row
    cross = dense_training_mask(anchors, packed.valid, 4, True, window)[:, 0, :, :packed.valid.shape[1]]
    assert not torch.equal(dense[:, 0, :, :packed.valid.shape[1]], cross)
