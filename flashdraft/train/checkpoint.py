"""Training checkpoints on disk: the one place that writes, lists and reads them (and cuts the log back on resume).

Layout (under a run's `output_dir`):
- `checkpoints/step-XXXXXXXX/` (8-digit step), one per save, written as `step-XXXXXXXX.tmp/` and renamed (atomic);
  a `.tmp` directory or one without `trainer_state.pt` is an incomplete write and never listed:
  - `drafter/`: the drafter in the reference format (`DFlashDraftModel.save_pretrained`, float32 weights in
    `model.safetensors` + `config.json`),
  - `trainer_state.pt`: step, epoch, epoch_step, next_sample_position, optimizer, scheduler, world_size,
    global_batch, num_examples, total_steps, config (a dict),
  - `rng-rankRRRRR.pt`: each rank's Python / torch / CUDA RNG states.
  Only the newest `keep` complete checkpoints are kept.
- `train_log.jsonl`: one JSON record per line; on resume the records from beyond the checkpoint's step are dropped.

Saving and resuming are collective: every rank calls them with its rank and a barrier; rank 0 writes the shared
files, each rank its own RNG state.

What this module does not know about: the training loop, how the data position maps to examples (it stores and
compares the step, global batch and example count it is given), how models and optimizers are built (it fills
the ones it is passed), process groups (it only calls `barrier`), and the final export (`trainer.py`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import torch

LOG_NAME = "train_log.jsonl"
STATE_NAME = "trainer_state.pt"
CHECKPOINTS_DIR = "checkpoints"
DRAFTER_DIR = "drafter"
WEIGHTS_NAME = "model.safetensors"


def _no_barrier() -> None:
    return None


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f"step-{int(step):08d}"


def rng_path(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / f"rng-rank{int(rank):05d}.pt"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")
                  and not p.name.endswith(".tmp") and (p / STATE_NAME).exists())


def save_checkpoint(output_dir: str | Path, step: int, *, drafter, optimizer, scheduler, steps_per_epoch: int,
                    global_batch: int, world_size: int, num_examples: int, total_steps: int, config: dict,
                    keep: int, rank: int = 0, barrier: Callable[[], None] = _no_barrier) -> Path:
    """Write the checkpoint of `step` (all ranks call this) and prune to the newest `keep`; returns its directory."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(rng_state(), rng_path(tmp, rank))
    barrier()
    if rank == 0:
        drafter.save_pretrained(tmp / DRAFTER_DIR, dtype=torch.float32)
        epoch, es = divmod(step, steps_per_epoch)
        torch.save({
            "step": step, "epoch": epoch, "epoch_step": es, "next_sample_position": es * global_batch,
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "world_size": world_size, "global_batch": global_batch,
            "num_examples": num_examples, "total_steps": total_steps, "config": config,
        }, tmp / STATE_NAME)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[: -max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(Path(checkpoint) / STATE_NAME, map_location="cpu", weights_only=False)


def load_drafter_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(checkpoint) / DRAFTER_DIR / WEIGHTS_NAME))


def load_rng_state(checkpoint: Path, rank: int) -> dict | None:
    path = rng_path(checkpoint, rank)
    return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None


def check_data_position(checkpoint: Path, state: dict, global_batch: int, num_examples: int) -> None:
    """The step count is the data position only for the same global batch over the same examples."""
    if state["global_batch"] != global_batch or state["num_examples"] != num_examples:
        raise ValueError(f"{checkpoint}: saved with global batch {state['global_batch']} over {state['num_examples']} "
                         f"examples; now {global_batch} over {num_examples}: the data position would "
                         "not carry over. Resume with the same data and global batch.")


def resume(output_dir: str | Path, *, drafter, optimizer, scheduler, global_batch: int, num_examples: int,
           rank: int = 0, barrier: Callable[[], None] = _no_barrier) -> int | None:
    """Load the newest complete checkpoint into drafter / optimizer / scheduler / RNG (all ranks call this).

    Returns its step, or None when there is none (then the log is removed: the run starts afresh). Rank 0 cuts the
    log back to that step and records a `resume` event.
    """
    out = Path(output_dir)
    ckpts = list_checkpoints(out)
    if not ckpts:
        if rank == 0:
            (out / LOG_NAME).unlink(missing_ok=True)
        barrier()
        return None
    ckpt = ckpts[-1]
    state = load_trainer_state(ckpt)
    check_data_position(ckpt, state, global_batch, num_examples)
    drafter.load_checkpoint_state(load_drafter_weights(ckpt), source=str(ckpt))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    step = int(state["step"])
    rng = load_rng_state(ckpt, rank)
    if rng is not None:
        set_rng_state(rng)
    if rank == 0:
        truncate_log(out / LOG_NAME, step)
        append_log(out / LOG_NAME, {"event": "resume", "step": step, "checkpoint": str(ckpt)})
    barrier()
    return step


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def append_log(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop log records from beyond `step` (they belong to work lost in the kill and redone after resume)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if rec.get("step", 0) <= step:
            keep.append(json.dumps(rec))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)
