"""FSDP2-sharded frozen target (`--shard-target`, torchrun, gloo on CPU): training equals one unsharded process, and
a target built sharded from its files (meta device) equals the same target loaded whole."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from test_train_distributed import COMMON, _cli, _in_process, _log, _run, _weights, setup  # noqa: F401  (fixture)

torch.set_num_threads(1)


def test_sharded_target_two_processes_equal_one_process(setup, tmp_path):  # noqa: F811
    """2 ranks x 2 sequences with the target's layers sharded across them (and the AdamW moments: ZeRO-1) == 1 rank
    x 4 with the whole target; a run resumed from a mid-run checkpoint (moments gathered, then split again)
    finishes with the same weights.

    The sharded forward all-gathers each layer's weights before running it, so the features are the unsharded
    ones; what differs is float summation order (DDP's gradient all-reduce), hence the DDP test's tolerances.
    """
    args = [*COMMON, "--max-steps", "4", "--save-every", "2", "--target", str(setup / "target"),
            "--data", str(setup / "data.jsonl"), "--output-dir", str(tmp_path / "fsdp"), "--batch-size", "2",
            "--shard-target", "--shard-optimizer"]
    _cli(args, nproc=2)
    single = _in_process(setup, tmp_path / "one", max_steps=4, save_every=4, batch_size=4)
    log = _log(tmp_path / "fsdp")
    start = next(r for r in log if r.get("event") == "start")
    assert start["world_size"] == 2 and start["config"]["shard_target"]
    one_start = next(r for r in _log(tmp_path / "one") if r.get("event") == "start")
    # each rank holds half of every decoder layer (the embedding, norm and lm_head whole): strictly less than all
    assert start["target_bytes_per_process"] < one_start["target_bytes_per_process"]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 4 and max(losses) - min(losses) > 1e-3  # it trained
    assert torch.allclose(torch.tensor(losses), torch.tensor(single.losses), atol=1e-4), (losses, single.losses)
    w, w_one = _weights(tmp_path / "fsdp" / "final"), _weights(tmp_path / "one" / "final")
    assert w.keys() == w_one.keys()
    for k in w:
        assert torch.allclose(w[k], w_one[k], atol=2e-5, rtol=1e-4), (k, (w[k] - w_one[k]).abs().max())
    shutil.rmtree(tmp_path / "fsdp" / "checkpoints" / "step-00000004")
    shutil.rmtree(tmp_path / "fsdp" / "final")
    _cli([*args, "--resume"], nproc=2)
    assert [r["step"] for r in _log(tmp_path / "fsdp") if r.get("event") == "resume"] == [2]
    resumed = _weights(tmp_path / "fsdp" / "final")
    for k in w:
        assert torch.allclose(resumed[k], w[k], atol=1e-6), (k, (resumed[k] - w[k]).abs().max())


def test_sharded_target_refuses_what_needs_the_whole_target(setup, tmp_path):  # noqa: F811
    from flashdraft.train.trainer import TrainConfig, check_config

    for extra in ({"feature_cache": str(tmp_path / "fc")}, {"eval_prompts": str(setup / "data.jsonl")}):
        with pytest.raises(ValueError, match="shard_target"):
            check_config(TrainConfig(shard_target=True, **extra))


def test_target_built_sharded_from_its_files_equals_it_whole(setup, tmp_path):  # noqa: F811
    """Qwen3 (untied, default RoPE) and Llama (tied embeddings, llama3 RoPE scaling, an odd row count that shards
    unevenly): features and logits of the sharded build equal the whole model's, in 2 processes."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=51, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    script = Path(__file__).with_name("sharded_features.py")
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
          str(setup / "target"), str(tmp_path / "llama")])
