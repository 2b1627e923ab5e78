"""Training checkpoints on disk: the one place that writes, lists and reads them (and cuts the log back on resume).

Layout (under a run's `output_dir`):
- `checkpoints/step-XXXXXXXX/` (8-digit step), one per save, written as `step-XXXXXXXX.tmp/` and renamed (atomic);
  a `.tmp` directory or one without `manifest.json` (nor, for checkpoints of older versions, `trainer_state.pt`)
  is an incomplete write and never listed (nor is a `.damaged` one, set aside by a resume):
  - `drafter/`: the drafter in the reference format (`DFlashDraftModel.save_pretrained`, float32 weights in
    `model.safetensors` + `config.json`),
  - `trainer_state.pt`: step, epoch, epoch_step, next_sample_position, optimizer, scheduler, world_size,
    global_batch, num_examples, total_steps, config (a dict),
  - `rng-rankRRRRR.pt`: each rank's Python / torch / CUDA RNG states,
  - `manifest.json`, written last (via a temporary file and a rename, after every other file is synced): the
    format version, the step, and each file's relative path, size and sha256.
  Only the newest `keep` complete checkpoints are kept. State and RNG files hold only tensors, numbers, strings,
  lists, tuples and dicts, and are read with `torch.load(weights_only=True)`: nothing in an output directory is
  unpickled as code.
- Resuming verifies the newest checkpoint's manifest (every file present, same size, same sha256) and falls back
  to the newest intact one, with a warning on stderr (and a `checkpoint_skipped` log record) naming each broken
  one and renaming it `step-XXXXXXXX.damaged`; a file that cannot be read is treated the same way. Checkpoints
  of older versions (no manifest) are still resumed, unverified, with a warning. No intact checkpoint at all is
  an error, not a fresh start.
- `train_log.jsonl`: one JSON record per line; on resume the records from beyond the checkpoint's step are dropped.

Saving and resuming are collective: every rank calls them with its rank and a barrier; rank 0 writes the shared
files, each rank its own RNG state.

What this module does not know about: the training loop, how the data position maps to examples (it stores and
compares the step, global batch and example count it is given), how models and optimizers are built (it fills
the ones it is passed), process groups (it only calls `barrier`), and the final export (`trainer.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch

LOG_NAME = "train_log.jsonl"
STATE_NAME = "trainer_state.pt"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
DAMAGED_SUFFIX = ".damaged"
_STEP_DIR = re.compile(r"^step-\d{8}$")  # not step-XXXXXXXX.tmp (being written) nor .damaged (set aside)
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


class NoIntactCheckpoint(ValueError):
    """`--resume` found checkpoints, but every one of them is damaged."""


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run (renamed into place, with a manifest or an older version's state file),
    oldest first. Complete is not intact: `verify_checkpoint` checks the files against the manifest."""
    root = checkpoint_root(output_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)
                  and ((p / MANIFEST_NAME).exists() or (p / STATE_NAME).exists()))


def _sha256(path: Path, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())  # the data reaches the disk before the manifest that vouches for it
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(checkpoint: Path, step: int) -> Path:
    """Hash every file under `checkpoint` (syncing each) and write `manifest.json` atomically, last."""
    checkpoint = Path(checkpoint)
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        rel = path.relative_to(checkpoint).as_posix()
        if rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
            continue
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path, sync=True)}
    for directory in {p.parent for p in checkpoint.rglob("*") if p.is_file()}:
        _fsync_dir(directory)
    tmp = checkpoint / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": MANIFEST_FORMAT, "step": int(step), "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / MANIFEST_NAME)
    _fsync_dir(checkpoint)
    return checkpoint / MANIFEST_NAME


def verify_checkpoint(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint's files, in a few words, or None when they match its manifest.

    A checkpoint of an older version (no manifest, a state file) cannot be verified and passes (`resume` warns)."""
    checkpoint = Path(checkpoint)
    manifest_path = checkpoint / MANIFEST_NAME
    if not manifest_path.exists():
        return None if (checkpoint / STATE_NAME).exists() else f"no {MANIFEST_NAME}"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST_NAME} ({type(exc).__name__}: {exc})"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"{MANIFEST_NAME} has format {manifest.get('format')!r}, this version reads {MANIFEST_FORMAT}"
    for required in (STATE_NAME, f"{DRAFTER_DIR}/{WEIGHTS_NAME}"):
        if required not in files:
            return f"{MANIFEST_NAME} does not list {required}"
    for rel, entry in sorted(files.items()):
        path = checkpoint / rel
        if not isinstance(entry, dict) or ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"{MANIFEST_NAME}: bad entry for {rel!r}"
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{rel} has {size} bytes, the manifest says {entry.get('size')} (truncated or overwritten)"
        if _sha256(path) != entry.get("sha256"):
            return f"{rel} does not match its sha256 in the manifest (corrupted)"
    return None


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
        write_manifest(tmp, step)  # last: every other rank's RNG file is in place (barrier above)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        for old in list_checkpoints(output_dir)[: -max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(Path(checkpoint) / STATE_NAME, map_location="cpu", weights_only=True)


def load_drafter_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(checkpoint) / DRAFTER_DIR / WEIGHTS_NAME))


def load_rng_state(checkpoint: Path, rank: int) -> dict | None:
    path = rng_path(checkpoint, rank)
    return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None


def check_data_position(checkpoint: Path, state: dict, global_batch: int, num_examples: int) -> None:
    """The step count is the data position only for the same global batch over the same examples."""
    if state["global_batch"] != global_batch or state["num_examples"] != num_examples:
        raise ValueError(f"{checkpoint}: saved with global batch {state['global_batch']} over {state['num_examples']} "
                         f"examples; now {global_batch} over {num_examples}: the data position would "
                         "not carry over. Resume with the same data and global batch.")


def warn(message: str) -> None:
    print(f"flashdraft train: warning: {message}", file=sys.stderr, flush=True)


def read_checkpoint(checkpoint: Path, rank: int = 0) -> tuple[dict, dict[str, torch.Tensor], dict | None]:
    """(trainer state, drafter weights, this rank's RNG state or None), read without applying any of it."""
    return load_trainer_state(checkpoint), load_drafter_weights(checkpoint), load_rng_state(checkpoint, rank)


def newest_intact(output_dir: str | Path, rank: int = 0) -> tuple[Path, tuple, list[tuple[Path, str]]] | None:
    """The newest checkpoint that matches its manifest and can be read: (path, `read_checkpoint` of it, the newer
    ones skipped with the reason). None when there is no checkpoint; NoIntactCheckpoint when all are damaged.

    Every rank verifies every file (the RNG files of all ranks are in the manifest), so all ranks choose the same."""
    ckpts = list_checkpoints(output_dir)
    if not ckpts:
        return None
    skipped: list[tuple[Path, str]] = []
    for ckpt in reversed(ckpts):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            try:
                return ckpt, read_checkpoint(ckpt, rank), skipped
            except Exception as exc:  # noqa: BLE001 - a file that verifies but cannot be read is damaged too
                problem = f"cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        skipped.append((ckpt, problem))
    raise NoIntactCheckpoint(f"--resume: no intact checkpoint in {checkpoint_root(output_dir)}: "
                             + "; ".join(f"{p.name}: {why}" for p, why in skipped))


def resume(output_dir: str | Path, *, drafter, optimizer, scheduler, global_batch: int, num_examples: int,
           rank: int = 0, barrier: Callable[[], None] = _no_barrier) -> int | None:
    """Load the newest intact checkpoint into drafter / optimizer / scheduler / RNG (all ranks call this).

    Returns its step, or None when there is none (then the log is removed: the run starts afresh). Damaged newer
    checkpoints are skipped with a warning naming each (rank 0). Rank 0 cuts the log back to the step resumed from
    and records `checkpoint_skipped` and `resume` events.
    """
    out = Path(output_dir)
    found = newest_intact(out, rank)
    if found is None:
        if rank == 0:
            (out / LOG_NAME).unlink(missing_ok=True)
        barrier()
        return None
    ckpt, (state, weights, rng), skipped = found
    barrier()  # every rank has chosen before rank 0 sets the damaged ones aside
    if rank == 0:
        for broken, why in skipped:
            aside = broken.with_name(broken.name + DAMAGED_SUFFIX)
            try:
                if aside.exists():
                    shutil.rmtree(aside)
                os.replace(broken, aside)  # out of the listing (and of pruning), kept for inspection
            except OSError:
                aside = broken
            warn(f"checkpoint {broken} is damaged ({why}); skipping it (set aside as {aside.name})")
        if skipped:
            warn(f"resuming from {ckpt}, the newest intact checkpoint")
        if not (ckpt / MANIFEST_NAME).exists():
            warn(f"checkpoint {ckpt} has no {MANIFEST_NAME} (written by an older version): resumed unverified")
    check_data_position(ckpt, state, global_batch, num_examples)
    drafter.load_checkpoint_state(weights, source=str(ckpt))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    step = int(state["step"])
    if rng is not None:
        set_rng_state(rng)
    if rank == 0:
        truncate_log(out / LOG_NAME, step)
        for broken, why in skipped:
            append_log(out / LOG_NAME, {"event": "checkpoint_skipped", "step": step, "checkpoint": str(broken),
                                        "reason": why})
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
