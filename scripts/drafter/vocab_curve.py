"""Draft time per cycle and greedy tau over draft vocabulary sizes: the curve behind `--draft-vocab-size`.

    python scripts/drafter/vocab_curve.py --vocab-data data/default_pair/regen_mix [--draft DIR]
        [--sizes 1024,2048,4096,8192] [--rows 1,4,16] [--num 12] [--lengths prompt,256] [--threads 1]
        [--no-tau] [--out runs/vocab_curve]

For each size N, the drafter (the shipped one by default) reads out over the N most frequent response tokens of the
regenerated training data (`--vocab-data`, as `flashdraft train --draft-vocab-size` chooses them) through those rows
of the target's lm_head (`restrict_drafter`); N = the target's vocabulary is the drafter as it is. Then:
- draft time per cycle: the engine's own drafting step (`DFlashProposer._draft_tokens`: write the newly committed
  context, one block forward, read-out, argmax) of whole blocks at each `--rows` batch size (1 by default) after a
  context of `--context` tokens, sizes interleaved round by round, median over `--reps` rounds of the thread's CPU
  time with one thread (wall time on a shared machine measures the other jobs), of wall time with more; the
  engine's default CPU weight packing applies as when serving;
- tau: `eval_tau.py`'s cells (in-domain and out-of-domain, mid-line and newline endings, `--lengths`), pooled and
  mean and p10 over prompts.
Writes `results.json`, `results.md` and `vocab_curve.png` into `--out`. Say whether the machine was shared when
quoting the timings.

What this script does not know about: training a drafter with a reduced vocabulary (`flashdraft train`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.drafter.eval_tau import (SETS, build_cells, measure, pair_arguments, percentile,  # noqa: E402
                                     response_counts, restrict_vocab, save_figure)


def draft_step_ms(engines: dict, context: int, reps: int, rows: int = 1, new_tokens: int = 6) -> dict:
    """Median CPU ms (this thread's CPU time: with one torch thread every op runs here, and other jobs on a shared
    machine do not inflate it as they inflate wall time; with more threads, wall time) of one drafting step per
    engine for `rows` rows: `new_tokens` newly committed positions per row written into the drafter's cache (a
    typical accepted length), then one whole block drafted per row, after `context` positions already cached."""
    import torch

    from flashdraft.engine.batch import RowBuckets

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    setups = {}
    for name, engine in engines.items():
        proposer, drafter = engine.proposer, engine.drafter
        state = proposer.new_batch_state(RowBuckets())
        state.kv = drafter.new_cache(rows, context + 64)
        width = len(drafter.target_layer_ids) * drafter.target_hidden_size
        g = torch.Generator().manual_seed(0)
        past = torch.randn(rows, context, width, generator=g).to(drafter.dtype)
        positions = torch.arange(context)[None].expand(rows, -1)
        drafter.write_context(state.kv, past, positions, torch.ones_like(positions, dtype=torch.bool))
        feats = torch.randn(rows, new_tokens, width, generator=g).to(drafter.dtype)
        new_pos = torch.arange(context, context + new_tokens)[None].expand(rows, -1)
        block = torch.full((rows, engine.block_size), drafter.mask_token_id, dtype=torch.long)
        block[:, 0] = 5
        block_pos = torch.arange(context + new_tokens, context + new_tokens + engine.block_size)[None].expand(rows, -1)
        setups[name] = (proposer, (state.kv, feats, new_pos, torch.ones_like(new_pos, dtype=torch.bool), block,
                                   block_pos, context + new_tokens))
    times = {name: [] for name in engines}
    with torch.inference_mode():
        for rep in range(reps + 3):
            for name, (proposer, args) in setups.items():
                t0 = clock()
                proposer._draft_tokens(*args)
                if rep >= 3:  # warm-up rounds
                    times[name].append(clock() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def plot(rows: list[dict], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size"] for r in rows]
    with_tau = "tau" in rows[0]
    fig, axes = plt.subplots(1, 2 if with_tau else 1, figsize=(11 if with_tau else 6, 4.2), squeeze=False)
    ax1 = axes[0][0]
    for batch in rows[0]["draft_ms"]:
        full = rows[-1]["draft_ms"][batch]
        ax1.plot(sizes, [r["draft_ms"][batch] / full for r in rows], marker="o", label=f"{batch} row(s): {full:.1f} ms "
                 "at the largest")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("draft vocabulary size")
    ax1.set_ylabel("draft step per cycle, vs the largest size")
    ax1.set_ylim(bottom=0)
    ax1.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax1.legend(fontsize=8)
    ax1.set_title("draft time (whole blocks)")
    ax2 = axes[0][-1]
    for name, marker in zip(SETS if with_tau else (), ("o", "s")):
        ax2.plot(sizes, [r["tau"][name]["mean"] for r in rows], marker=marker, label=f"{name} (mean over prompts)")
        ax2.plot(sizes, [r["tau"][name]["p10"] for r in rows], marker=marker, ls="--", label=f"{name} (p10)")
    if with_tau:
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("draft vocabulary size")
        ax2.set_ylabel("greedy tau (block 16)")
        ax2.set_title("acceptance")
        ax2.legend(fontsize=8)
    fig.suptitle(f"reduced draft vocabulary: {label}")
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_arguments(ap)
    ap.add_argument("--vocab-data", type=Path, required=True, help="regenerated training data to count tokens in")
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--num", type=int, default=12, help="prompts per eval_tau cell")
    ap.add_argument("--lengths", default="prompt,256")
    ap.add_argument("--context", type=int, default=256, help="cached context of the timed draft steps")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rows", default="1", help="batch sizes the draft step is timed at (comma-separated)")
    ap.add_argument("--no-tau", action="store_true", help="time only")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "vocab_curve")
    args = ap.parse_args(argv)

    import torch

    from flashdraft.engine import EngineConfig, SpecEngine
    from flashdraft.loading import load_pair

    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(args.target, args.draft, "cpu")
    vocab = int(target.config.vocab_size)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if not sizes or sizes[0] < 1 or sizes[-1] > vocab:
        ap.error(f"--sizes must lie in [1, {vocab}]")
    counts = response_counts(args.vocab_data, tokenizer, vocab)
    drafters = {n: drafter if n == vocab else restrict_vocab(drafter, target, counts, n) for n in sizes}
    # every cycle drafts, without the prompt-lookup splice: tau of the drafter alone
    config = EngineConfig(block_size=16, draft_policy="fixed", lookup_splice=0)
    engines = {n: SpecEngine(target, d, tokenizer, config) for n, d in drafters.items()}
    batches = [int(b) for b in args.rows.split(",")]
    if min(batches) < 1:
        ap.error("--rows must be positive")
    draft_ms = {b: draft_step_ms(engines, args.context, args.reps, rows=b) for b in batches}
    coverage = {n: float(counts[torch.sort(-counts, stable=True).indices[:n]].sum() / counts.sum()) for n in sizes}
    rows = []
    cells = None if args.no_tau else build_cells(tokenizer, args.num, [x for x in args.lengths.split(",") if x])
    for n in sizes:
        row = {"size": n, "draft_ms": {b: round(draft_ms[b][n], 4) for b in batches},
               "response_token_coverage": round(coverage[n], 5)}
        if cells is not None:
            res = measure(engines[n], cells, 128, tokenizer.eos_token_id, progress=True)
            row["tau"] = {}
            for name in SETS:
                taus = [t for key, r in res.items() if key.startswith(name + "|") for t in r["per_prompt_tau"]]
                row["tau"][name] = {"mean": round(statistics.fmean(taus), 4), "p10": round(percentile(taus, 0.1), 4),
                                    "prompts": len(taus)}
        rows.append(row)
        print(json.dumps(row))
    args.out.mkdir(parents=True, exist_ok=True)
    label = args.draft or "shipped drafter, read-out restricted (no retraining)"
    (args.out / "results.json").write_text(json.dumps({"label": label, "args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows}, indent=1))
    full = next(r for r in rows if r["size"] == sizes[-1])
    unit = "CPU ms" if args.threads == 1 else "ms"
    lines = [f"{label}; draft step of whole blocks, {args.threads} thread(s), context {args.context}", "",
             "| draft vocab | response tokens covered | "
             + " | ".join(f"draft {unit}/cycle, {b} row(s) (vs largest)" for b in batches) + " |"
             + ("" if args.no_tau else " tau in-domain (mean/prompt) | tau ood (mean/prompt) |"),
             "|---|---|" + "---|" * len(batches) + ("" if args.no_tau else "---|---|")]
    for r in rows:
        line = (f"| {r['size']} | {100 * r['response_token_coverage']:.2f}% | "
                + " | ".join(f"{r['draft_ms'][b]:.3f} ({r['draft_ms'][b] / full['draft_ms'][b]:.2f}x)" for b in batches)
                + " |")
        if not args.no_tau:
            line += "".join(f" {r['tau'][s]['mean']:.2f} ({100 * (r['tau'][s]['mean'] / full['tau'][s]['mean'] - 1):+.1f}%) |"
                            for s in SETS)
        lines.append(line)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.out / "vocab_curve.png", label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
