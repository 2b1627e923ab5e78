"""DDP (torchrun, gloo on CPU) equivalence, gradient-accumulation equivalence, and kill -> resume -> finish."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from flashdraft.train.synthetic import BOS, MASK, progression, tiny_target_config
from flashdraft.train.trainer import TrainConfig, Trainer

torch.set_num_threads(1)
COMMON = ["--block-size", "4", "--num-draft-layers", "1", "--mask-token-id", str(MASK), "--num-anchors", "6",
          "--lr", "3e-3", "--no-progress", "--no-eval-at-start", "--max-length", "40", "--seed", "3"]
KILLED_TRAIN = Path(__file__).with_name("killed_train.py")  # `flashdraft train`, hard-exit (75) after N steps


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    torch.manual_seed(0)
    cfg = tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1, num_layers=4)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    g = torch.Generator().manual_seed(0)
    with open(root / "data.jsonl", "w") as f:
        for i in range(24):
            n_prompt = int(torch.randint(2, 6, (1,), generator=g))
            n = int(torch.randint(14, 30, (1,), generator=g))
            ids = [BOS] + progression(i * 7, 1 + i % 3, n - 1, 60)
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * n_prompt + [1] * (n - n_prompt)}) + "\n")
    return root


def _run(cmd, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _cli(args, nproc=1, check=True):
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "flashdraft.train.cli", "train", *args]
    else:
        cmd = [sys.executable, "-m", "flashdraft.train.cli", "train", *args]
    return _run(cmd, check=check)


def _killed_cli(args, after_steps):
    """`flashdraft train args` in one process, hard-killed (exit 75) once `after_steps` steps are done."""
    return _run([sys.executable, str(KILLED_TRAIN), str(after_steps), *args], check=False)


def _in_process(setup, out, **kw):
    base = dict(target=str(setup / "target"), data=str(setup / "data.jsonl"), output_dir=str(out), block_size=4,
                num_draft_layers=1, mask_token_id=MASK, num_anchors=6, lr=3e-3, progress=False, eval_at_start=False,
                max_length=40, seed=3)
    base.update(kw)
    return Trainer(TrainConfig(**base)).train()


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _log(path):
    return [json.loads(line) for line in open(path / "train_log.jsonl")]


def _recomputed_losses(setup, out, weight_dirs):
    """{k: loss of global step k+1} recomputed in one process from the weights saved after step k (weight_dirs[k];
    None: the initial weights), independently of any log: anchors are a function of (seed, epoch, example), so the loss of a step
    depends only on the weights it starts from. lr=0 and weights reloaded before every step: nothing trains here."""
    trainer = Trainer(TrainConfig(target=str(setup / "target"), data=str(setup / "data.jsonl"), output_dir=str(out),
                                  block_size=4, num_draft_layers=1, mask_token_id=MASK, num_anchors=6, lr=0.0,
                                  progress=False, eval_at_start=False, max_length=40, seed=3, batch_size=4,
                                  max_steps=100))
    initial = {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}
    losses = {}
    for step, d in weight_dirs.items():
        trainer.drafter.load_checkpoint_state(initial if d is None else _weights(d), source=str(d))
        losses[step] = trainer.train_step(step)["loss"]
    return [losses[k] for k in sorted(losses)]


def test_torchrun_two_processes_equal_one_process(setup, tmp_path):
    """Same global batch (4): 2 ranks x 2, 1 rank x 4, and 1 rank x 2 x 2 accumulation give the same training.

    The loss of a step is normalised by the label-weight sum of the whole global batch (all-reduced), so the
    gradients agree exactly in real arithmetic; what differs is float summation order (DDP's all-reduce of
    gradients, per-micro-batch padding), hence a small tolerance.
    """
    steps = ["--max-steps", "5", "--save-every", "1", "--keep-checkpoints", "5"]
    _cli([*COMMON, *steps, "--target", str(setup / "target"), "--data", str(setup / "data.jsonl"),
          "--output-dir", str(tmp_path / "ddp"), "--batch-size", "2"], nproc=2)
    single = _in_process(setup, tmp_path / "one", max_steps=5, save_every=5, batch_size=4)
    accum = _in_process(setup, tmp_path / "acc", max_steps=5, save_every=5, batch_size=2, grad_accum=2)
    ddp_log = [r for r in _log(tmp_path / "ddp") if "loss" in r]
    start = next(r for r in _log(tmp_path / "ddp") if r.get("event") == "start")
    assert start["world_size"] == 2 and start["global_batch"] == 4
    one_log = [r for r in _log(tmp_path / "one") if "loss" in r]
    assert [r["step"] for r in ddp_log] == [1, 2, 3, 4, 5]
    for a, b in zip(ddp_log, one_log):
        assert sorted(a["samples"]) == sorted(b["samples"])  # the same examples in every step
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["loss"], b["loss"])
    for other in (single, accum):
        assert torch.allclose(torch.tensor(other.losses), torch.tensor([r["loss"] for r in ddp_log]), atol=1e-4)
    w_ddp = _weights(tmp_path / "ddp" / "checkpoints" / "step-00000005" / "drafter")
    for run in ("one", "acc"):
        w = _weights(tmp_path / run / "checkpoints" / "step-00000005" / "drafter")
        assert w.keys() == w_ddp.keys()
        for k in w:
            assert torch.allclose(w[k], w_ddp[k], atol=2e-5, rtol=1e-4), (run, k, (w[k] - w_ddp[k]).abs().max())
    # the logged DDP losses are those its own saved weights give, recomputed here in one process from the
    # checkpoints of steps 0 (initial) .. 4 (and they change from step to step: the weights moved)
    ckpt = tmp_path / "ddp" / "checkpoints"
    recomputed = _recomputed_losses(setup, tmp_path / "re", {0: None, **{k: ckpt / f"step-{k:08d}" / "drafter"
                                                                         for k in range(1, 5)}})
    assert torch.allclose(torch.tensor(recomputed), torch.tensor([r["loss"] for r in ddp_log]), atol=1e-4), \
        (recomputed, [r["loss"] for r in ddp_log])
    assert max(recomputed) - min(recomputed) > 1e-3
    init = _in_process(setup, tmp_path / "zero", max_steps=1, save_every=1, batch_size=4, lr=0.0)
    w0 = _weights(tmp_path / "zero" / "final")
    assert any((w0[k] - w_ddp[k]).abs().max() > 1e-3 for k in w0), "training must have moved the weights"
    assert init.steps == 1


def test_kill_then_resume_continues_without_repeating_data(setup, tmp_path):
    out = tmp_path / "run"
    args = [*COMMON, "--target", str(setup / "target"), "--data", str(setup / "data.jsonl"), "--output-dir", str(out),
            "--batch-size", "4", "--max-steps", "10", "--save-every", "3", "--keep-checkpoints", "2"]
    killed = _killed_cli(args, after_steps=8)
    assert killed.returncode == 75, killed.stderr[-3000:]
    before = [r for r in _log(out) if "loss" in r]
    assert [r["step"] for r in before] == list(range(1, 9))
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-00000003", "step-00000006"], ckpts  # periodic, pruned to the newest two
    assert not (out / "final").exists()
    (out / "checkpoints" / "step-00000009.tmp").mkdir()  # a checkpoint write cut by a kill is ignored
    _cli([*args, "--resume"])
    log = _log(out)
    steps = [r for r in log if "loss" in r]
    resume = [r for r in log if r.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 6
    # the curve continues: every step once; the lines of steps 1-6 are kept from before the kill (they precede the
    # resume event), the lines of 7.. were written after it by the resumed process
    assert [r["step"] for r in steps] == list(range(1, 11))
    at_resume = log.index(resume[0])
    assert [r["step"] for r in log[:at_resume] if "loss" in r] == list(range(1, 7))
    assert [r["step"] for r in log[at_resume:] if "loss" in r] == list(range(7, 11))
    assert steps[:6] == before[:6]
    # steps 7 and 8 ran twice, before the kill and after the resume: recomputed, not copied, they agree
    for old, new in zip(before[6:8], steps[6:8]):
        assert abs(old["loss"] - new["loss"]) < 1e-6 and old["samples"] == new["samples"]
        assert abs(old["grad_norm"] - new["grad_norm"]) < 1e-5
    # the resumed losses are those the resumed run's own saved weights give, recomputed in a separate process
    # (checkpoints 9 and 10 were written after the resume; step 10's loss comes from step 9's weights)
    recomputed, = _recomputed_losses(setup, tmp_path / "re", {9: out / "checkpoints" / "step-00000009" / "drafter"})
    assert abs(recomputed - steps[9]["loss"]) < 1e-5, (recomputed, steps[9]["loss"])
    # no data position repeated: 6 steps per epoch (24 examples / 4); within an epoch every example once
    positions = [(r["epoch"], r["epoch_step"]) for r in steps]
    assert len(set(positions)) == len(positions) == 10
    for epoch in (0, 1):
        seen = [s for r in steps if r["epoch"] == epoch for s in r["samples"]]
        assert len(seen) == len(set(seen))
    # and the result equals an uninterrupted run
    ref = _in_process(setup, tmp_path / "ref", batch_size=4, max_steps=10, save_every=3)
    assert torch.allclose(torch.tensor(ref.losses), torch.tensor([r["loss"] for r in steps]), atol=1e-5)
    w_ref, w = _weights(tmp_path / "ref" / "final"), _weights(out / "final")
    for k in w:
        assert torch.allclose(w[k], w_ref[k], atol=1e-5), k
    state = torch.load(out / "checkpoints" / "step-00000010" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 10 and state["epoch"] == 1 and state["epoch_step"] == 4
