"""The drafter checkpoint format: reference layout in, reference layout out, and clear errors for bad input."""

import json

import pytest
import torch
from safetensors.torch import save_file

from flashdraft import (
    CheckpointError,
    DFlashDraftModel,
    PairMismatchError,
    SamplingParams,
    SpecEngine,
    default_target_layer_ids,
)
from tiny import MASK_ID, greedy_reference, make_drafter, make_target


def reference_checkpoint(directory, target_config, num_layers=2, block_size=4, nested=True, seed=0):
    """Write a drafter the way the reference implementation's checkpoints look: hand-built config + state dict."""
    H, heads, kv, hd, inter = 32, 4, 2, 8, 48
    layer_ids = default_target_layer_ids(target_config.num_hidden_layers, num_layers)
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 512,
        "max_window_layers": num_layers,
        "num_attention_heads": heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": kv,
        "num_target_layers": target_config.num_hidden_layers,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": target_config.vocab_size,
        "block_size": block_size,
    }
    if nested:
        config["dflash_config"] = {"mask_token_id": MASK_ID, "target_layer_ids": layer_ids}
    else:  # oldest layout: everything at top level
        config.update(mask_token_id=MASK_ID, target_layer_ids=layer_ids)
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    state = {"fc.weight": w(H, len(layer_ids) * H), "hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
             "norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(num_layers):
        p = f"layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": w(heads * hd, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
            p + "self_attn.v_proj.weight": w(kv * hd, H), p + "self_attn.o_proj.weight": w(H, heads * hd),
            p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
            p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return config, state


@pytest.mark.parametrize("nested", [True, False], ids=["dflash_config", "top-level-fields"])
def test_reference_checkpoint_loads_and_drives_generation(tmp_path, nested):
    target = make_target("qwen3")
    config, state = reference_checkpoint(tmp_path / "ref", target.config, nested=nested)
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "ref")
    assert drafter.block_size == 4 and drafter.mask_token_id == MASK_ID
    assert drafter.target_layer_ids == default_target_layer_ids(target.config.num_hidden_layers, 2)
    for name, tensor in state.items():
        assert torch.equal(drafter.state_dict()[name], tensor.float()), name
    drafter = drafter.double()
    prompt = [5, 6, 7, 8]
    out = drafter.spec_generate(target, torch.tensor([prompt]), max_new_tokens=20, stop_token_ids=None)
    assert out.shape == (1, 24)
    assert out[0, 4:].tolist() == greedy_reference(target, prompt, 20)


def test_save_pretrained_round_trip_keeps_reference_layout(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=8, num_layers=3, dtype=torch.float32)
    drafter.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": drafter.target_layer_ids,
                                       "block_size": 8}
    assert config["block_size"] == 8 and config["num_target_layers"] == target.config.num_hidden_layers
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "hidden_norm.weight" in keys and "norm.weight" in keys
    assert "layers.0.self_attn.q_norm.weight" in keys
    assert not any(k.startswith(("model.", "embed", "lm_head", "rotary")) for k in keys)
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_default_target_layer_ids_match_reference():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B: docs/design.md, 'Drafter architecture'
    assert default_target_layer_ids(24, 1) == [12]
    assert default_target_layer_ids(64, 2) == [1, 61]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]


@pytest.mark.parametrize(
    "field,change",
    [
        ("vocab_size", {"vocab_size": 200}),
        ("target_layer_ids", {"target_layer_ids": [1, 9]}),
        ("mask_token_id", {"mask_token_id": 500}),
        ("num_target_layers", {"num_target_layers": 12}),
    ],
)
def test_mismatched_pair_is_refused_naming_the_field(tmp_path, field, change):
    target = make_target("qwen3")
    config, _ = reference_checkpoint(tmp_path / "ref", target.config)
    for key, value in change.items():
        (config["dflash_config"] if key in config["dflash_config"] else config)[key] = value
    (tmp_path / "ref" / "config.json").write_text(json.dumps(config))
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "ref")
    with pytest.raises(PairMismatchError, match=field):
        SpecEngine(target, drafter)


def test_drafter_for_a_wider_target_is_refused():
    drafter = make_drafter(make_target("qwen3"))
    drafter.config.hidden_size = 48
    with pytest.raises(PairMismatchError, match="hidden_size: drafter has 48, target has 32"):
        SpecEngine(make_target("qwen3"), drafter)


def test_corrupt_checkpoints_fail_clearly(tmp_path):
    target = make_target("qwen3")
    good = tmp_path / "good"
    reference_checkpoint(good, target.config)
    blob = (good / "model.safetensors").read_bytes()

    cases = {}
    d = tmp_path / "truncated"
    d.mkdir()
    (d / "config.json").write_text((good / "config.json").read_text())
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    cases[d] = "corrupt or truncated"
    d = tmp_path / "badjson"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    (d / "model.safetensors").write_bytes(blob)
    cases[d] = "cannot parse"
    d = tmp_path / "pickle"
    d.mkdir()
    (d / "config.json").write_text((good / "config.json").read_text())
    torch.save({}, d / "pytorch_model.bin")
    cases[d] = "pickle weights are not loaded"
    d = tmp_path / "noconfig"
    d.mkdir()
    cases[d] = "no config.json"
    d = tmp_path / "missing"
    d.mkdir()
    (d / "config.json").write_text((good / "config.json").read_text())
    from safetensors.torch import load_file

    state = load_file(str(good / "model.safetensors"))
    state.pop("fc.weight")
    save_file(state, str(d / "model.safetensors"))
    cases[d] = "missing \\['fc.weight'\\]"
    d = tmp_path / "nan"
    d.mkdir()
    (d / "config.json").write_text((good / "config.json").read_text())
    state = load_file(str(good / "model.safetensors"))
    state["norm.weight"][0] = float("nan")
    save_file(state, str(d / "model.safetensors"))
    cases[d] = "NaN"
    for directory, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            DFlashDraftModel.from_pretrained(directory)
    with pytest.raises(CheckpointError, match="no such directory"):
        DFlashDraftModel.from_pretrained(tmp_path / "does-not-exist")


def test_bad_generation_requests_fail_clearly():
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 2, 10_000]])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="exceed"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=10_000))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([[1, 2]], SamplingParams(stop_strings=("x",)))
