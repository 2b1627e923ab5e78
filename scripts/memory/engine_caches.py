"""K/V memory the engine holds against the tokens its rows hold, measured on the shipped default pair.

    python scripts/memory/engine_caches.py --json after.json            # uniform rows: table (+ JSON) for this checkout
    python scripts/memory/engine_caches.py --mixed --json after.json    # one long row among short ones
    PYTHONPATH=/path/to/old/checkout python scripts/memory/engine_caches.py --json before.json   # another engine
    python scripts/memory/engine_caches.py --plot docs/bench/engine_kv_memory.png --before before.json --after after.json

Each point runs in a fresh process: the pair is loaded (bf16, CPU, one thread), R rows join one live batch
(`SpecEngine.add`, as the server's scheduler admits them) and run one cycle (the drafter's cache is allocated at the
first draft). Uniform mode (default; `--rows`, `--lengths`): every row has a prompt of L tokens. Mixed mode
(`--mixed`; `--rows`, `--lengths` for L, `--short` for S): one row has a prompt of L tokens, the other R-1 rows
S tokens, which shows whether memory follows the longest row or the sum of the rows. Every row's max_tokens is
half its own prompt.

Then it reads back the bytes of the K/V tensors the batch holds (`kv_bytes`: the target's cache and the drafter's
context cache, the exact figure) and the growth of the process's RSS over the pair's own (`rss_growth`: what the OS
sees once glibc has returned freed heap pages; the cycle's transient buffers that the allocator keeps are included).
`held_tokens` is the sum over rows of the tokens each holds (`longest`: the most one row holds), and `needed` the
sum over rows of (tokens held + a block) x bytes per position: what caches holding exactly the tokens would take.
The script only uses the engine's public API and `flashdraft.memory.batch_kv_bytes`, so the same file measures an
older checkout (PYTHONPATH) for a before/after comparison; `--plot` draws both from their JSON (either mode, told
apart by the points' keys).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MiB = 2**20


def rss_bytes() -> int:
    """This process's resident memory, after glibc returned the heap pages freed since (transient buffers)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS as it is
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(prompt_lengths: list[int]) -> dict:
    """One batch whose rows have prompts of these lengths, in this process (the script runs each point in a fresh
    one: `--point`): the bytes and tokens it holds after one cycle."""
    import torch

    import flashdraft
    from flashdraft.engine import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair
    from flashdraft.memory import batch_kv_bytes, engine_bytes_per_position

    print(f"flashdraft: {flashdraft.__file__}", file=sys.stderr)  # which checkout is measured (PYTHONPATH)
    torch.set_num_threads(1)
    target, tokenizer, drafter = load_pair(None, None, "cpu", "bfloat16")
    engine = SpecEngine(target, drafter, tokenizer)
    with torch.inference_mode():  # the pair's own lazily built state (packed weights, caches of one row) first
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0.0))
    base = rss_bytes()
    params = [SamplingParams(max_new_tokens=n // 2, temperature=0.0) for n in prompt_lengths]
    batch = engine.open_batch()
    prompts = [[5 + (i + j) % 50 for j in range(n)] for i, n in enumerate(prompt_lengths)]
    engine.add(batch, prompts, params, request_ids=list(range(len(prompts))))
    engine.step(batch)
    target_bytes, drafter_bytes = engine_bytes_per_position(engine)
    tokens_per_row = [r.n_cached for r in batch.rows]
    return {"held_tokens": sum(tokens_per_row), "longest": max(tokens_per_row), "kv_bytes": batch_kv_bytes(batch),
            "needed": sum(n + engine.block_size for n in tokens_per_row) * (target_bytes + drafter_bytes),
            "rss_growth": rss_bytes() - base}


def point_prompts(point: tuple[int, ...]) -> tuple[dict, list[int]]:
    """A point's description (the JSON keys that say what was measured) and its rows' prompt lengths:
    (rows, length) is uniform, (rows, long, short) is mixed: one long row, the rest short."""
    if len(point) == 2:
        rows, length = point
        return {"rows": rows, "length": length}, [length] * rows
    rows, long_length, short_length = point
    return ({"rows": rows, "long_length": long_length, "short_length": short_length},
            [long_length] + [short_length] * (rows - 1))


def run_points(points: list[tuple[int, ...]]) -> list[dict]:
    out = []
    for point in points:
        proc = subprocess.run([sys.executable, __file__, "--point", ",".join(map(str, point))], capture_output=True,
                              text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"point {point} failed")
        if not out:  # once: where the measured engine came from
            print(next(line for line in proc.stderr.splitlines() if line.startswith("flashdraft: ")),
                  file=sys.stderr)
        p = json.loads(proc.stdout.strip().splitlines()[-1])
        out.append(p)
        print(f"| {' | '.join(map(str, point))} | {p['held_tokens']} | {p['kv_bytes'] / MiB:.2f} | "
              f"{p['needed'] / MiB:.2f} | {p['rss_growth'] / MiB:.1f} |", flush=True)
    return out


def plot(path: str, runs: dict[str, list[dict]], heading: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed = any("long_length" in p for points in runs.values() for p in points)
    x_key = "long_length" if mixed else "length"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    styles = {"before": ("s:", 0.6), "after": ("o-", 1.0)}
    for ax, key, title in ((axes[0], "kv_bytes", "K/V tensors held"), (axes[1], "rss_growth", "process RSS growth")):
        for label, points in runs.items():
            marker, alpha = styles.get(label, ("o-", 1.0))
            for count in sorted({p["rows"] for p in points}):
                mine = [p for p in points if p["rows"] == count]
                ax.plot([p[x_key] for p in mine], [p[key] / MiB for p in mine], marker, alpha=alpha,
                        label=f"{label}: {count} rows")
        after = runs.get("after") or next(iter(runs.values()))
        for count in sorted({p["rows"] for p in after}):
            mine = [p for p in after if p["rows"] == count]
            ax.plot([p[x_key] for p in mine], [p["needed"] / MiB for p in mine], "--", color="grey", lw=0.8,
                    label="tokens held x bytes" if count == max(p["rows"] for p in after) else None)
        if mixed:
            short = sorted({p["short_length"] for points in runs.values() for p in points})
            ax.set_xlabel(f"long row's prompt tokens (other rows: {', '.join(map(str, short))}; "
                          "max_tokens = half of each prompt)", fontsize=8)
        else:
            ax.set_xlabel("prompt tokens per row (max_tokens = half of it)")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    if heading:
        fig.suptitle(heading, fontsize=8)
    elif mixed:
        fig.suptitle("Engine K/V memory on the default pair (bf16, CPU), one long row among short ones\nbefore: every "
                     "row at the longest row's capacity (one rectangle, chunks of 256); after: paged caches",
                     fontsize=8)
    else:
        fig.suptitle("Engine K/V memory on the default pair (bf16, CPU): before = power-of-two reservation for "
                     "prompt + max_tokens, after = growth in chunks of 256 with the tokens held", fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixed", action="store_true", help="one row of each --lengths among --short rows")
    p.add_argument("--rows", type=int_list, help="rows per batch (default 1,4,16; --mixed 4,16)")
    p.add_argument("--lengths", type=int_list, help="prompt tokens per row, with --mixed the long row's "
                   "(default 64,128,200,300,450,600,800,1000,1300; --mixed 64,200,450,800,1300)")
    p.add_argument("--short", type=int, default=64, help="--mixed: prompt tokens of the short rows")
    p.add_argument("--json", help="write the points here")
    p.add_argument("--plot", help="draw --before/--after JSON files (no measuring)")
    p.add_argument("--before")
    p.add_argument("--title", help="--plot: what before and after are (default: the measurements in BENCHMARKS.md)")
    p.add_argument("--after")
    p.add_argument("--point", help=argparse.SUPPRESS)  # ROWS,LENGTH or ROWS,LONG,SHORT: one point, JSON on stdout
    args = p.parse_args(argv)
    if args.point:
        description, prompt_lengths = point_prompts(tuple(int_list(args.point)))
        print(json.dumps({**description, **measure(prompt_lengths)}))
        return
    if args.plot:
        runs = {label: json.loads(Path(f).read_text()) for label, f in (("before", args.before),
                                                                         ("after", args.after)) if f}
        if not runs:
            p.error("--plot needs --before and/or --after JSON files")
        plot(args.plot, runs, args.title)
        return
    if args.mixed:
        rows, lengths = args.rows or [4, 16], args.lengths or [64, 200, 450, 800, 1300]
        points = [(r, n, args.short) for r in rows for n in lengths]
        print("| rows | long row's prompt tokens | short rows' prompt tokens | tokens held (sum) | K/V held (MiB) | "
              "tokens held x bytes (MiB) | RSS growth (MiB) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
    else:
        rows, lengths = args.rows or [1, 4, 16], args.lengths or [64, 128, 200, 300, 450, 600, 800, 1000, 1300]
        points = [(r, n) for r in rows for n in lengths]
        print("| rows | prompt tokens (max_tokens half) | tokens held (sum) | K/V held (MiB) | "
              "tokens held x bytes (MiB) | RSS growth (MiB) |")
        print("|---:|---:|---:|---:|---:|---:|")
    measured = run_points(points)
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=1))


if __name__ == "__main__":
    main()
