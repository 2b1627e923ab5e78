"""What a drafting engine costs where drafting does not pay: DFlash against plain decoding in one process, timed by
the process's own CPU time (what another process on a shared machine does not move), batches interleaved.

    python scripts/speed/idle_overhead.py [--batch 1,16] [--temperature 1] [--dataset default] [--num-prompts 64]
        [--max-new-tokens 64] [--rounds 4] [--json runs/idle_overhead.json]

At temperature 1 the shipped pair's default policy drafts almost never (the first probes of each request and a
few later ones), so the ratio is the engine's cost of keeping drafting possible: the target's tapped features and
the rows' pending context, the policy's bookkeeping, the probes it still takes, lookup steps. Each batch size runs
`--num-prompts` prompts as batches of that many rows (`SpecEngine.generate`), plain decoding and DFlash in turn,
the order alternating per round. Prints per batch size the ms per token of each engine and the ratio
(DFlash speed / plain speed), and what DFlash did: its drafting cycles (row-cycles) and the tokens they committed,
its lookup steps.

What this script does not know about: a server's joins and leaves (`engine_concurrency.py`), wall time under load
(`serve_sweep.py`).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.engine import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402


def measure(engines: dict, prompts: list[list[int]], batch: int, temperature: float, max_new_tokens: int,
            rounds: int) -> dict:
    totals = {name: {"cpu_s": 0.0, "tokens": 0, "drafting_cycles": 0, "drafted_tokens_committed": 0,
                     "lookup_steps": 0} for name in engines}
    for rnd in range(rounds):
        order = list(engines.items()) if rnd % 2 == 0 else list(reversed(engines.items()))
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=start + i)
                      for i in range(len(chunk))]
            for name, engine in order:
                started = time.thread_time()
                results = engine.generate(chunk, params)
                t = totals[name]
                t["cpu_s"] += time.thread_time() - started
                for r in results:
                    t["tokens"] += len(r.token_ids)
                    t["drafting_cycles"] += len(r.stats.acceptance_lengths)
                    t["drafted_tokens_committed"] += sum(r.stats.acceptance_lengths)
                    t["lookup_steps"] += r.stats.lookup_steps
    for t in totals.values():
        t["ms_per_token"] = 1000 * t["cpu_s"] / max(t["tokens"], 1)
    return {"batch": batch, **totals, "ratio": totals["plain"]["cpu_s"] / totals["dflash"]["cpu_s"]}


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,16", help="batch sizes (comma-separated)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dataset", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if min(batches) < 1 or args.num_prompts < 1 or args.rounds < 1 or args.max_new_tokens < 1:
        ap.error("--batch, --num-prompts, --rounds and --max-new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair()
    prompts = [tokenizer.encode(p.text) for p in load_prompts(args.dataset, args.num_prompts)]
    engines = {"plain": SpecEngine(target, None, tokenizer), "dflash": SpecEngine(target, drafter, tokenizer)}
    cells = []
    for batch in batches:
        for engine in engines.values():
            engine.warmup(batch)  # as the server does: every width's kernels run, the policy's costs are timed
        cell = measure(engines, prompts, batch, args.temperature, args.max_new_tokens, args.rounds)
        cells.append(cell)
        p, d = cell["plain"], cell["dflash"]
        print(f"batch {batch}, T = {args.temperature}: plain {p['ms_per_token']:.3f} ms/token, DFlash "
              f"{d['ms_per_token']:.3f} ms/token -> {cell['ratio']:.3f}x; DFlash drafting cycles "
              f"{d['drafting_cycles']} committing {d['drafted_tokens_committed']} tokens, lookup steps "
              f"{d['lookup_steps']}, of {d['tokens']} tokens")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
