"""Training curves of one or more `flashdraft train` runs, side by side, from their `train_log.jsonl`.

    python scripts/drafter/plot_training.py runs/A runs/B [--names A,B] [--smooth 50] [--out curves.png]

Four panels against the step, each a moving average over `--smooth` logged steps (one logged step is one batch, so
the raw values are noisy): the loss, the teacher-forced accuracy of the first draft position and of all positions
(the marginal's argmax against the label), the DFlash2 selector's teacher-forced accuracy (runs that have one), and
the learning rate. Prints each run's last smoothed values.

What this script does not know about: tau (the accuracies are per position and teacher-forced; `eval_tau.py`
measures acceptance) and the trainer's held-out evaluations (their lines carry no `loss`, and are skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from flashdraft.train.checkpoint import LOG_NAME


def read_log(run: Path) -> dict[str, np.ndarray]:
    """The run's training steps as arrays: step, loss, lr, first-position and mean accuracy, selector accuracy
    (NaN where a step logged none)."""
    path = run / LOG_NAME if run.is_dir() else run
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: {e}")
    rows = [r for r in rows if "loss" in r and "acc_per_position" in r]
    if not rows:
        raise SystemExit(f"error: {path} holds no training steps")
    return {
        "step": np.array([r["step"] for r in rows]),
        "loss": np.array([r["loss"] for r in rows]),
        "lr": np.array([r["lr"] for r in rows]),
        "first position": np.array([r["acc_per_position"][0] for r in rows]),
        "all positions": np.array([float(np.mean(r["acc_per_position"])) for r in rows]),
        "selector": np.array([r.get("selector_acc", np.nan) for r in rows], dtype=float),
    }


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (shorter at the start), NaN-aware."""
    out = np.empty_like(values, dtype=float)
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out[i] = np.nanmean(part) if np.isfinite(part).any() else np.nan
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (or train_log.jsonl files)")
    ap.add_argument("--names", default=None, help="comma-separated legend names (default: the directory names)")
    ap.add_argument("--smooth", type=int, default=50, help="moving-average window in logged steps (>= 1)")
    ap.add_argument("--out", type=Path, default=Path("training_curves.png"))
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else [r.name for r in args.runs]
    if len(names) != len(args.runs):
        ap.error(f"--names gives {len(names)} names for {len(args.runs)} runs")
    if args.smooth < 1:
        ap.error("--smooth must be >= 1")
    logs = [read_log(run) for run in args.runs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for name, log in zip(names, logs):
        x = log["step"]
        curves = {k: smooth(v, args.smooth) for k, v in log.items() if k not in ("step", "lr")}
        line = axes[0].plot(x, curves["loss"], label=name)[0]
        axes[1].plot(x, curves["all positions"], color=line.get_color(), label=f"{name}: all")
        axes[1].plot(x, curves["first position"], color=line.get_color(), linestyle="--", label=f"{name}: first")
        if np.isfinite(curves["selector"]).any():
            axes[2].plot(x, curves["selector"], color=line.get_color(), label=name)
        axes[3].plot(x, log["lr"], color=line.get_color(), label=name)
        last = {**{k: v[-1] for k, v in curves.items()}, "lr": log["lr"][-1]}
        print(f"{name}: step {x[-1]}, " + ", ".join(f"{k} {v:.4g}" for k, v in last.items() if np.isfinite(v)))
    titles = ["loss", "teacher-forced accuracy (marginal)", "selector accuracy (DFlash2)", "learning rate"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"moving average over {args.smooth} logged steps")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
