"""Issue 22, finding 4: every checkpoint carries a manifest (sizes, sha256) written last; `--resume` verifies it and
falls back to the newest intact checkpoint with a warning naming the damaged one (a truncated file, 4 KiB of zeros
inside the weights, a missing file); state and RNG are read with `torch.load(weights_only=True)`, so a pickle in the
output directory is never executed; checkpoints of the previous format (no manifest) still resume."""

import hashlib
import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from flashdraft.cli import main
from flashdraft.train import checkpoint as ckpt_mod
from flashdraft.train.synthetic import MASK, tiny_target_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A target, data, and one finished 4-step run saving at steps 2 and 4: `reference` (its final weights are
    what any resumed run must reproduce)."""
    root = tmp_path_factory.mktemp("integrity")
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1,
                                        num_layers=2)).save_pretrained(root / "target")
    with open(root / "data.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"input_ids": [1] + [4 + (i * 5 + k) % 50 for k in range(23)],
                                "loss_mask": [0] * 3 + [1] * 21}) + "\n")
    assert main(_argv(root, root / "reference")) == 0
    return root


def _argv(root, out, *extra):
    return ["train", "--target", str(root / "target"), "--data", str(root / "data.jsonl"), "--output-dir", str(out),
            "--block-size", "4", "--num-draft-layers", "1", "--mask-token-id", str(MASK), "--num-anchors", "4",
            "--batch-size", "2", "--max-length", "24", "--lr", "3e-3", "--max-steps", "4", "--save-every", "2",
            "--keep-checkpoints", "2", "--seed", "3", "--no-progress", "--no-eval-at-start", "--device", "cpu", *extra]


def _copy(runs, tmp_path):
    """The reference run as if killed after its step-4 checkpoint: no export yet."""
    out = tmp_path / "run"
    shutil.copytree(runs / "reference", out)
    shutil.rmtree(out / "final")
    return out


def _final_equals_reference(runs, out):
    w_ref = load_file(str(runs / "reference" / "final" / "model.safetensors"))
    w = load_file(str(out / "final" / "model.safetensors"))
    assert w.keys() == w_ref.keys()
    for k in w:
        assert torch.allclose(w[k], w_ref[k], atol=1e-5), k


def _resume_events(out):
    return [r for r in map(json.loads, open(out / "train_log.jsonl")) if r.get("event") == "resume"]


def test_manifest_lists_every_file_with_size_and_sha256(runs):
    for name in ("step-00000002", "step-00000004"):
        ckpt = runs / "reference" / "checkpoints" / name
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["format"] == 1 and manifest["step"] == int(name[5:])
        on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()
                         and p.name != "manifest.json")
        assert sorted(manifest["files"]) == on_disk
        assert {"trainer_state.pt", "drafter/model.safetensors", "drafter/config.json",
                "rng-rank00000.pt"} <= set(on_disk)
        for rel, entry in manifest["files"].items():
            data = (ckpt / rel).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert ckpt_mod.verify_checkpoint(ckpt) is None
        assert not list(ckpt.glob("*.tmp"))


def test_state_files_load_without_pickle(runs):
    ckpt = runs / "reference" / "checkpoints" / "step-00000004"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4 and state["optimizer"]["state"] and state["scheduler"]["last_epoch"] == 4
    rng = torch.load(ckpt / "rng-rank00000.pt", weights_only=True)
    assert set(rng) >= {"python", "torch"}


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _zeros_inside(path):
    with open(path, "r+b") as f:  # same size: only the checksum can tell
        f.seek(path.stat().st_size // 2)
        f.write(b"\0" * 4096)


def _delete(path):
    path.unlink()


def _garble(path):
    path.write_text("{not json")


DAMAGE = {
    "truncated-weights": ("drafter/model.safetensors", _truncate),
    "zeros-in-weights": ("drafter/model.safetensors", _zeros_inside),
    "truncated-state": ("trainer_state.pt", _truncate),
    "zeros-in-state": ("trainer_state.pt", _zeros_inside),
    "truncated-rng": ("rng-rank00000.pt", _truncate),
    "missing-config": ("drafter/config.json", _delete),
    "garbled-manifest": ("manifest.json", _garble),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_checkpoint(runs, tmp_path, capsys, damage):
    out = _copy(runs, tmp_path)
    rel, spoil = DAMAGE[damage]
    spoil(out / "checkpoints" / "step-00000004" / rel)
    assert main(_argv(runs, out, "--resume")) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert any("step-00000004" in line and "damaged" in line for line in warnings), err
    assert "Traceback" not in err
    resume, = _resume_events(out)
    assert resume["step"] == 2 and resume["checkpoint"].endswith("step-00000002")
    skipped = [r for r in map(json.loads, open(out / "train_log.jsonl")) if r.get("event") == "checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0]["checkpoint"].endswith("step-00000004")
    _final_equals_reference(runs, out)  # steps 3-4 redone from step 2: the same weights as the unbroken run
    # the damaged one was set aside (kept for inspection, never listed again); a fresh step 4 was written
    assert (out / "checkpoints" / "step-00000004.damaged").is_dir()
    assert ckpt_mod.verify_checkpoint(out / "checkpoints" / "step-00000004") is None


def test_intact_newest_is_used_without_warnings(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    assert main(_argv(runs, out, "--resume")) == 0
    assert "warning" not in capsys.readouterr().err
    resume, = _resume_events(out)
    assert resume["step"] == 4
    _final_equals_reference(runs, out)


def test_no_intact_checkpoint_is_one_line_error(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    for name in ("step-00000002", "step-00000004"):
        _truncate(out / "checkpoints" / name / "drafter" / "model.safetensors")
    assert main(_argv(runs, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "no intact checkpoint" in err and "step-00000002" in err and "step-00000004" in err
    assert not (out / "final").exists()


def test_previous_format_without_manifest_still_resumes(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    for name in ("step-00000002", "step-00000004"):
        (out / "checkpoints" / name / "manifest.json").unlink()
    assert ckpt_mod.list_checkpoints(out) == [out / "checkpoints" / "step-00000002",
                                              out / "checkpoints" / "step-00000004"]
    assert main(_argv(runs, out, "--resume")) == 0
    err = capsys.readouterr().err
    assert "no manifest.json" in err and "step-00000004" in err, err
    resume, = _resume_events(out)
    assert resume["step"] == 4
    _final_equals_reference(runs, out)


class _Payload:
    """Unpickling this runs `open(marker, 'w')`: what a planted trainer_state.pt could do with weights_only=False."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_in_the_output_directory_is_never_executed(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    marker = tmp_path / "pwned"
    # a previous-format checkpoint (no manifest, so not verified) whose state file is a hostile pickle
    planted = out / "checkpoints" / "step-00000006"
    shutil.copytree(out / "checkpoints" / "step-00000004", planted)
    (planted / "manifest.json").unlink()
    with open(planted / "trainer_state.pt", "wb") as f:
        pickle.dump({"step": 6, "x": _Payload(str(marker))}, f, protocol=2)
    with open(planted / "rng-rank00000.pt", "wb") as f:
        pickle.dump(_Payload(str(marker)), f, protocol=2)
    assert main(_argv(runs, out, "--resume")) == 0
    assert not marker.exists(), "a pickle from the output directory was executed"
    err = capsys.readouterr().err
    assert "step-00000006" in err and "cannot be read" in err, err
    resume, = _resume_events(out)
    assert resume["step"] == 4
    _final_equals_reference(runs, out)


def test_manifest_is_written_last_and_atomically(tmp_path, monkeypatch):
    """A save cut while hashing leaves no manifest, hence no listed checkpoint (only a .tmp directory)."""
    ckpt = tmp_path / "c"
    (ckpt / "drafter").mkdir(parents=True)
    (ckpt / "trainer_state.pt").write_bytes(b"x" * 10)
    (ckpt / "drafter" / "model.safetensors").write_bytes(b"y" * 10)
    real_replace = os.replace

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        ckpt_mod.write_manifest(ckpt, 1)
    assert not (ckpt / "manifest.json").exists()
    monkeypatch.setattr(os, "replace", real_replace)
    ckpt_mod.write_manifest(ckpt, 1)
    assert ckpt_mod.verify_checkpoint(ckpt) is None
    (ckpt / "trainer_state.pt").write_bytes(b"x" * 9 + b"z")
    assert "sha256" in ckpt_mod.verify_checkpoint(ckpt)
