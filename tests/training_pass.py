"""Shared by the training-pass tests (sliding-window and DFlash2 drafters): a tiny target, one random sequence cut
into blocks at given anchors, and each block decoded alone the way the engine decodes it (context cache + `draft`),
to compare with the training pass that computes all blocks in one forward."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import Qwen3ForCausalLM

from flashdraft.train.anchors import build_blocks, pad_anchors
from flashdraft.train.synthetic import MASK, tiny_target_config


def tiny_target():
    torch.manual_seed(0)
    cfg = tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1, num_layers=4)
    return Qwen3ForCausalLM(cfg).eval()


def one_sequence(drafter, target, length: int, anchors: list[int], block: int) -> SimpleNamespace:
    """Random tokens and target features of one sequence (float64), its blocks at `anchors` embedded for the
    drafter: noise [1, n*block, H], position_ids, feats, ctx_pos, valid, anchors [1, n]."""
    ids = torch.randint(3, 60, (1, length))
    feats = torch.randn(1, length, len(drafter.target_layer_ids) * 32, dtype=torch.float64)
    anchors, anchor_valid = pad_anchors([torch.tensor(anchors)])
    valid = torch.ones(1, length, dtype=torch.bool)
    blocks = build_blocks(ids, valid, anchors, anchor_valid, block, MASK)
    noise = drafter.embed(blocks.block_ids, target.get_input_embeddings().weight)
    return SimpleNamespace(noise=noise, position_ids=blocks.position_ids, feats=feats,
                           ctx_pos=torch.arange(length)[None], valid=valid, anchors=anchors)


def assert_blocks_decode_as_trained(drafter, seq: SimpleNamespace, trained: torch.Tensor, block: int) -> None:
    """Each block decoded alone over its context equals the training pass's hidden states for it."""
    for j, a in enumerate(seq.anchors[0].tolist()):
        cache = drafter.new_cache(1, seq.feats.shape[1] + block)
        drafter.write_context(cache, seq.feats[:, :a], seq.ctx_pos[:, :a], seq.valid[:, :a])
        span = slice(j * block, (j + 1) * block)
        decoded = drafter.draft(cache, seq.noise[:, span], seq.position_ids[:, span])
        assert torch.allclose(trained[:, span], decoded, atol=1e-10), j
