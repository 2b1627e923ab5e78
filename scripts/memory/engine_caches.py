"""K/V memory the engine holds vs the tokens its rows need: today's staircase, measured on the shipped default pair.

    python scripts/memory/engine_caches.py                      # table + docs/bench/engine_kv_memory.png
    python scripts/memory/engine_caches.py --rows 1,2,4,8,16 --lengths 100,300,700,1500

For each row count and length (prompt + max_tokens, the prompt a quarter of it), the rows join one live batch
(`SpecEngine.add`, as the server's scheduler does) and the script reads back the bytes of the K/V tensors the
batch holds: the target's static cache and the drafter's context cache, after one cycle (the drafter allocates its
cache at the first draft). Beside it: what the scheduler reserves for those rows (`flashdraft.memory`, the
`--kv-cache-memory` admission figure) and what a cache holding exactly the positions the rows need would take
(rows x length x bytes per position: the line growing caches would follow). The process RSS is printed too;
the tensor accounting is the exact figure. The pair runs in bf16 on CPU, one thread; nothing is generated beyond
one cycle.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.loading import load_pair
from flashdraft.memory import batch_kv_bytes, engine_bytes_per_position, reserved_positions, row_capacity


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(engine: SpecEngine, rows: int, length: int) -> dict:
    prompt = max(1, length // 4)
    params = SamplingParams(max_new_tokens=length - prompt, temperature=0.0)
    batch = engine.open_batch()
    engine.add(batch, [[5 + i % 50] * prompt for i in range(rows)], params, request_ids=list(range(rows)))
    engine.step(batch)
    target_bytes, drafter_bytes = engine_bytes_per_position(engine)
    per_position = target_bytes + drafter_bytes
    reserved = reserved_positions([row_capacity(prompt, length - prompt, engine.block_size)] * rows)
    return {"rows": rows, "length": length, "held": batch_kv_bytes(batch), "reserved": reserved * per_position,
            "needed": rows * (length + engine.block_size) * per_position, "rss": rss_bytes()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[64, 200, 300, 500, 700, 1000, 1500, 2000])
    p.add_argument("--plot", default="docs/bench/engine_kv_memory.png")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, tokenizer, drafter = load_pair(None, None, "cpu", "bfloat16")
    engine = SpecEngine(target, drafter, tokenizer)
    rows = [measure(engine, r, n) for r in args.rows for n in args.lengths]
    print("| rows | prompt + max_tokens | K/V held (MiB) | scheduler reserves (MiB) | needed exactly (MiB) "
          "| RSS (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|")
    mib = 2**20
    for r in rows:
        print(f"| {r['rows']} | {r['length']} | {r['held'] / mib:.2f} | {r['reserved'] / mib:.2f} | "
              f"{r['needed'] / mib:.2f} | {r['rss'] / mib:.0f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for count in args.rows:
            mine = [r for r in rows if r["rows"] == count]
            ax.plot([r["length"] for r in mine], [r["held"] / mib for r in mine], "o-", label=f"{count} rows: held")
            ax.plot([r["length"] for r in mine], [r["needed"] / mib for r in mine], "--", color="grey",
                    label="needed exactly" if count == args.rows[-1] else None)
        ax.set_xlabel("prompt + max_tokens per row")
        ax.set_ylabel("K/V memory (MiB)")
        ax.set_title("Engine K/V caches on the default pair (bf16): power-of-two reservation vs tokens needed")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=8)
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
