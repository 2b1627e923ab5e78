"""K/V memory the engine holds against the tokens its rows hold, measured on the shipped default pair.

    python scripts/memory/engine_caches.py --json after.json            # table (+ JSON) for this checkout
    PYTHONPATH=/path/to/old/checkout python scripts/memory/engine_caches.py --json before.json   # another engine
    python scripts/memory/engine_caches.py --plot docs/bench/engine_kv_memory.png --before before.json --after after.json

Each point (rows x length) runs in a fresh process: the pair is loaded (bf16, CPU, one thread), R rows with prompts
of L tokens and max_tokens L/2 join one live batch (`SpecEngine.add`, as the server's scheduler admits them) and run
one cycle (the drafter's cache is allocated at the first draft). Then it reads back the bytes of the K/V tensors
the batch holds (the target's static cache and the drafter's context cache: the exact figure), and the growth of
the process's RSS over the pair's own (what the OS sees once glibc has returned freed heap pages: the cycle's
transient buffers that the allocator keeps are included). `needed` is rows x (tokens held + a block) x bytes per position: what a cache holding exactly the
tokens would take. The script only uses the engine's public API and `flashdraft.memory.batch_kv_bytes`, so the same
file measures an older checkout (PYTHONPATH) for a before/after comparison; `--plot` draws both from their JSON.
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


def measure(rows: int, length: int) -> dict:
    """One point, in this process (the script runs each point in a fresh one: `--point`)."""
    import torch

    from flashdraft.engine import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair
    from flashdraft.memory import batch_kv_bytes, engine_bytes_per_position

    torch.set_num_threads(1)
    target, tokenizer, drafter = load_pair(None, None, "cpu", "bfloat16")
    engine = SpecEngine(target, drafter, tokenizer)
    with torch.inference_mode():  # the pair's own lazily built state (packed weights, caches of one row) first
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0.0))
    base = rss_bytes()
    params = SamplingParams(max_new_tokens=length // 2, temperature=0.0)
    batch = engine.open_batch()
    prompts = [[5 + (i + j) % 50 for j in range(length)] for i in range(rows)]
    engine.add(batch, prompts, params, request_ids=list(range(rows)))
    engine.step(batch)
    target_bytes, drafter_bytes = engine_bytes_per_position(engine)
    held_tokens = max(r.n_cached for r in batch.rows)
    return {"rows": rows, "length": length, "held_tokens": held_tokens, "kv_bytes": batch_kv_bytes(batch),
            "needed": rows * (held_tokens + engine.block_size) * (target_bytes + drafter_bytes),
            "rss_growth": rss_bytes() - base}


def run_points(rows: list[int], lengths: list[int]) -> list[dict]:
    out = []
    for r in rows:
        for n in lengths:
            proc = subprocess.run([sys.executable, __file__, "--point", f"{r},{n}"], capture_output=True, text=True,
                                  check=True)
            out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"| {r} | {n} | {out[-1]['kv_bytes'] / MiB:.2f} | {out[-1]['needed'] / MiB:.2f} | "
                  f"{out[-1]['rss_growth'] / MiB:.1f} |", flush=True)
    return out


def plot(path: str, runs: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    styles = {"before": ("s:", 0.6), "after": ("o-", 1.0)}
    for ax, key, title in ((axes[0], "kv_bytes", "K/V tensors held"), (axes[1], "rss_growth", "process RSS growth")):
        for label, points in runs.items():
            marker, alpha = styles.get(label, ("o-", 1.0))
            for count in sorted({p["rows"] for p in points}):
                mine = [p for p in points if p["rows"] == count]
                ax.plot([p["length"] for p in mine], [p[key] / MiB for p in mine], marker, alpha=alpha,
                        label=f"{label}: {count} rows")
        after = runs.get("after") or next(iter(runs.values()))
        for count in sorted({p["rows"] for p in after}):
            mine = [p for p in after if p["rows"] == count]
            ax.plot([p["length"] for p in mine], [p["needed"] / MiB for p in mine], "--", color="grey", lw=0.8,
                    label="tokens held x bytes" if count == max(p["rows"] for p in after) else None)
        ax.set_xlabel("prompt tokens per row (max_tokens = half of it)")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("Engine K/V memory on the default pair (bf16, CPU): before = power-of-two reservation for prompt + "
                 "max_tokens, after = growth in chunks of 256 with the tokens held", fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[64, 128, 200, 300, 450, 600, 800, 1000, 1300])
    p.add_argument("--json", help="write the points here")
    p.add_argument("--plot", help="draw --before/--after JSON files (no measuring)")
    p.add_argument("--before")
    p.add_argument("--after")
    p.add_argument("--point", help=argparse.SUPPRESS)  # ROWS,LENGTH: one point, JSON on stdout
    args = p.parse_args(argv)
    if args.point:
        rows, length = map(int, args.point.split(","))
        print(json.dumps(measure(rows, length)))
        return
    if args.plot:
        runs = {label: json.loads(Path(f).read_text()) for label, f in (("before", args.before),
                                                                         ("after", args.after)) if f}
        if not runs:
            p.error("--plot needs --before and/or --after JSON files")
        plot(args.plot, runs)
        return
    print("| rows | prompt tokens (max_tokens half) | K/V held (MiB) | tokens held x bytes (MiB) | RSS growth (MiB) |")
    print("|---:|---:|---:|---:|---:|")
    points = run_points(args.rows, args.lengths)
    if args.json:
        Path(args.json).write_text(json.dumps(points, indent=1))


if __name__ == "__main__":
    main()
