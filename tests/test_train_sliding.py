"""Sliding-window drafters can be trained: over a context several windows long, the training pass (many blocks in
one forward, one mask per kind of layer) gives each block exactly the hidden states the decoding path (context
cache + `draft`) gives it, and a short training run exports a drafter whose layers keep their windows."""

import pytest
import torch

from flashdraft.model.drafter import DFlashDraftModel, make_draft_config
from flashdraft.train.data import Example
from flashdraft.train.masks import training_mask
from flashdraft.train.synthetic import BOS, MASK, progression
from flashdraft.train.trainer import TrainConfig, Trainer, check_config
from training_pass import assert_blocks_decode_as_trained, one_sequence, tiny_target

torch.set_num_threads(1)
SLIDING = ["sliding_attention", "full_attention"]


def test_training_pass_equals_decoding_over_a_long_context():
    target = tiny_target().double()
    torch.manual_seed(1)
    drafter = DFlashDraftModel(make_draft_config(target.config, num_layers=2, block_size=4, mask_token_id=MASK,
                                                 layer_types=SLIDING, sliding_window=6)).double().eval()
    assert [layer.self_attn.sliding_window for layer in drafter.layers] == [6, None]
    block = 4
    seq = one_sequence(drafter, target, 72, [3, 20, 41, 66], block)  # a context twelve windows long
    kinds = {(layer.self_attn.sliding_window, layer.self_attn.is_causal) for layer in drafter.layers}
    masks = {k: training_mask("sdpa", seq.anchors, seq.valid, block, k[1], k[0]) for k in kinds}
    with torch.no_grad():
        trained = drafter(seq.noise, seq.position_ids, seq.feats, seq.ctx_pos, seq.valid, masks)
        full = drafter(seq.noise, seq.position_ids, seq.feats, seq.ctx_pos, seq.valid,
                       {k: masks[(None, False)] for k in kinds})
        assert_blocks_decode_as_trained(drafter, seq, trained, block)
    # the window matters at this length: ignoring it changes the blocks whose context is longer than it
    assert not torch.allclose(trained[:, -block:], full[:, -block:], atol=1e-6)


def test_sliding_drafter_trains_and_exports(tmp_path):
    g = torch.Generator().manual_seed(0)
    examples = []
    for i in range(8):
        n = int(torch.randint(60, 90, (1,), generator=g))
        ids = [BOS] + progression(i * 7, 1 + i % 3, n - 1, 60)
        examples.append(Example(torch.tensor(ids), torch.tensor([False] * 4 + [True] * (n - 4))))
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), block_size=4, num_draft_layers=2, mask_token_id=MASK,
                      num_anchors=16, lr=3e-3, max_length=96, batch_size=4, max_steps=8, progress=False,
                      eval_at_start=False, seed=0, layer_types=SLIDING, sliding_window=8, save_every=8)
    result = Trainer(cfg, target_model=tiny_target(), examples=examples).train()
    assert all(torch.isfinite(torch.tensor(result.losses))) and result.losses[-1] < result.losses[0]
    drafter = DFlashDraftModel.from_pretrained(result.final_dir)
    assert drafter.config.layer_types == SLIDING
    assert [(a.sliding_window, a.is_causal) for a in (layer.self_attn for layer in drafter.layers)] == \
        [(8, True), (None, False)]


def test_sliding_config_is_checked():
    for bad in ({"layer_types": SLIDING}, {"sliding_window": 8}, {"layer_types": ["sliding_attention"],
                                                                  "sliding_window": 8}):
        with pytest.raises(ValueError, match="layer_types|sliding_window"):
            check_config(TrainConfig(num_draft_layers=2, **bad))
