"""Issue 22, finding 2: NaN / inf weights are refused when loaded, naming the tensor, by every command (generate,
regenerate, train, serve, bench all load through `flashdraft.loading`); and training stops at the first
non-finite loss, naming the step and the batch, without exporting anything."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft.cli import main
from flashdraft.train.synthetic import MASK
from tiny import save_text_pair

torch.set_num_threads(1)
BAD = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("nanpair")
    save_text_pair(root, block_size=4, lm_head_scale=4.0)
    return root


def _poisoned(pair, tmp_path, value, name=BAD, what="target"):
    """A copy of the pair whose `what` checkpoint holds `value` in one element of weight `name`."""
    import shutil

    root = tmp_path / f"poisoned-{what}"
    shutil.copytree(pair, root)
    path = root / what / "model.safetensors"
    weights = load_file(str(path))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[7] = value
    save_file(weights, str(path), metadata={"format": "pt"})
    return root


def _one_line(capsys, rc, needles, code=2):
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert rc == code, (rc, out, err)
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_generate_refuses_a_nonfinite_target(pair, tmp_path, capsys, value):
    root = _poisoned(pair, tmp_path, value)
    rc = main(["generate", "--target", str(root / "target"), "--draft", str(root / "drafter"), "--prompt", "def f(x):",
               "--max-new-tokens", "4", "--device", "cpu"])
    _one_line(capsys, rc, ["--target", BAD, "NaN or inf"])
    rc = main(["generate", "--target", str(root / "target"), "--no-draft", "--prompt", "x", "--max-new-tokens", "2",
               "--device", "cpu"])
    _one_line(capsys, rc, [BAD])


def test_regenerate_refuses_a_nonfinite_target(pair, tmp_path, capsys):
    root = _poisoned(pair, tmp_path, math.nan)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    out = tmp_path / "regen"
    rc = main(["regenerate", "--target", str(root / "target"), "--data", str(prompts), "--output-dir", str(out),
               "--max-new-tokens", "4", "--no-progress", "--device", "cpu"])
    _one_line(capsys, rc, [BAD])
    assert not list(out.glob("shard-*.jsonl"))  # no shard of `response_ids: [0]` answers


def test_regenerate_function_refuses_a_nonfinite_model(pair, tmp_path):
    from flashdraft.loading import load_target
    from flashdraft.train.regenerate import regenerate

    model, tok = load_target(pair / "target", device="cpu")
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = math.nan
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight"):
        regenerate(model, [[5, 6, 7]], tmp_path / "r", tokenizer=tok, max_new_tokens=2, progress=False)
    assert not list((tmp_path / "r").glob("shard-*"))


def test_train_refuses_a_nonfinite_target(pair, tmp_path, capsys):
    root = _poisoned(pair, tmp_path, math.inf)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5 + (i + k) % 40 for k in range(20)]}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    rc = main(["train", "--target", str(root / "target"), "--data", str(data), "--output-dir", str(out),
               "--block-size", "4", "--num-draft-layers", "1", "--max-steps", "1", "--no-progress", "--device", "cpu"])
    _one_line(capsys, rc, [BAD])
    assert not (out / "final").exists()


def test_trainer_refuses_a_nonfinite_target_model_passed_in(pair, tmp_path):
    from flashdraft.loading import load_target
    from flashdraft.train.trainer import TrainConfig, Trainer

    model, tok = load_target(pair / "target", device="cpu")
    with torch.no_grad():
        model.lm_head.weight[3, 3] = math.nan
    with pytest.raises(ValueError, match=r"(lm_head|embed_tokens)\.weight contains NaN or inf"):
        Trainer(TrainConfig(output_dir=str(tmp_path / "run"), block_size=4, num_draft_layers=1, progress=False),
                target_model=model, tokenizer=tok, examples=[])


def test_serve_refuses_a_nonfinite_target(pair, tmp_path):
    from flashdraft.cli import build_parser
    from flashdraft.serve.cli import build_engine

    root = _poisoned(pair, tmp_path, math.nan)
    args = build_parser().parse_args(["serve", "--target", str(root / "target"), "--draft", str(root / "drafter"),
                                      "--device", "cpu"])
    with pytest.raises(ValueError, match=BAD):
        build_engine(args)


def test_nonfinite_drafter_is_refused_too(pair, tmp_path, capsys):
    root = _poisoned(pair, tmp_path, math.nan, name="fc.weight", what="drafter")
    rc = main(["generate", "--target", str(root / "target"), "--draft", str(root / "drafter"), "--prompt", "x",
               "--max-new-tokens", "2", "--device", "cpu"])
    _one_line(capsys, rc, ["fc.weight", "NaN or inf"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_parameter_finds_any_nan_or_inf(dtype, value):
    from flashdraft.loading import nonfinite_parameter

    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Identity(), torch.nn.Embedding(40, 8))
    model.empty = torch.nn.Parameter(torch.empty(0))  # skipped (aminmax has nothing to reduce)
    model = model.to(dtype)
    assert nonfinite_parameter(model) is None
    with torch.no_grad():
        model[2].weight.view(-1)[-1] = value  # the very last element of the last weight
    assert nonfinite_parameter(model) == "2.weight"
    with torch.no_grad():
        model[0].bias[0] = value
    assert nonfinite_parameter(model) == "0.bias"


# ---- training: the first non-finite loss stops it --------------------------------------------------------------

def _data(tmp_path):
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"input_ids": [1] + [4 + (i * 3 + k) % 50 for k in range(23)],
                                "loss_mask": [0] * 3 + [1] * 21}) + "\n")
    return data


@pytest.fixture(scope="module")
def ddp_target(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    from flashdraft.train.synthetic import tiny_target_config

    root = tmp_path_factory.mktemp("nanloss")
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1,
                                        num_layers=2)).save_pretrained(root / "target")
    return root / "target"


def _train_argv(target, data, out, *extra):
    return ["train", "--target", str(target), "--data", str(data), "--output-dir", str(out), "--block-size", "4",
            "--num-draft-layers", "1", "--mask-token-id", str(MASK), "--num-anchors", "4", "--batch-size", "2",
            "--max-length", "24", "--no-progress", "--no-eval-at-start", "--device", "cpu", *extra]


def test_training_stops_at_the_first_nonfinite_loss(ddp_target, tmp_path, capsys, monkeypatch):
    """Step 3's loss is made NaN: steps 1-2 are logged and checkpointed, step 3 stops the run naming the step and
    its examples, the optimizer never applies it, and nothing is exported."""
    from flashdraft.train import trainer as trainer_mod

    real = trainer_mod.dflash_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:  # one micro-step per optimizer step: the third step
            out.loss = out.loss * math.nan
            out.weighted_sum = out.weighted_sum * math.nan
        return out

    monkeypatch.setattr(trainer_mod, "dflash_loss", poisoned)
    out = tmp_path / "run"
    rc = main(_train_argv(ddp_target, _data(tmp_path), out, "--max-steps", "6", "--save-every", "1",
                          "--keep-checkpoints", "5"))
    err = _one_line(capsys, rc, ["step 3 ", "not finite", "examples [", "step-00000002"], code=1)
    assert not (out / "final").exists() and not (out / "final.tmp").exists()
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    assert [r["step"] for r in log if "loss" in r and r.get("event") is None] == [1, 2]
    stop = [r for r in log if r.get("event") == "nonfinite"]
    assert len(stop) == 1 and stop[0]["step"] == 3 and len(stop[0]["samples"]) == 2
    assert all(str(i) in err for i in stop[0]["samples"])
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-00000001", "step-00000002"], ckpts
    weights = load_file(str(out / "checkpoints" / "step-00000002" / "drafter" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_diverging_training_exits_nonzero_and_exports_nothing(ddp_target, tmp_path, capsys):
    """A real divergence (lr 1e30: the weights leave the float range) stops at its first non-finite step."""
    out = tmp_path / "run"
    rc = main(_train_argv(ddp_target, _data(tmp_path), out, "--max-steps", "8", "--lr", "1e30", "--warmup-ratio", "0"))
    err = _one_line(capsys, rc, ["not finite"], code=1)
    assert not (out / "final").exists()
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    finite = [r["step"] for r in log if "loss" in r and r.get("event") is None]
    stop, = [r for r in log if r.get("event") == "nonfinite"]
    assert finite == list(range(1, stop["step"])) and f"step {stop['step']} " in err


def test_export_refuses_nonfinite_drafter_weights(ddp_target, tmp_path):
    from flashdraft.train.trainer import NonFiniteLoss, TrainConfig, Trainer

    trainer = Trainer(TrainConfig(target=str(ddp_target), data=str(_data(tmp_path)), output_dir=str(tmp_path / "run"),
                                  block_size=4, num_draft_layers=1, mask_token_id=MASK, num_anchors=4, max_length=24,
                                  progress=False, eval_at_start=False, max_steps=1, device="cpu"))
    with torch.no_grad():
        trainer.drafter.fc.weight[0, 0] = math.nan
    with pytest.raises(NonFiniteLoss, match="fc.weight"):
        trainer.export()
    assert not (tmp_path / "run" / "final").exists()
