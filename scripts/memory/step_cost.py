"""Median time of one engine step for a batch of R rows of L prompt tokens: what a cache layout costs under load.

    python scripts/memory/step_cost.py 16 300                              # this checkout
    PYTHONPATH=/path/to/other/checkout python scripts/memory/step_cost.py 16 300   # another engine

The shipped pair (CPU defaults, one thread); R synthetic prompts of L tokens join one live batch, 5 steps warm
up, then the median of 60 `SpecEngine.step` calls is printed for plain decoding and for DFlash with the fixed
policy (every row verifies the full block: the widest reads of the caches). Only the public engine API is used, so
the same file times an older checkout; run the checkouts interleaved, several times (this machine is shared).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.loading import load_pair


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", type=int)
    p.add_argument("length", type=int)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, tok, drafter = load_pair(device="cpu")
    prompts = [[5 + (i * 7 + j) % 50 for j in range(args.length)] for i in range(args.rows)]
    out = []
    for name, draft_model, options in (("plain", None, {}), ("dflash-fixed", drafter, {"draft_policy": "fixed"})):
        engine = SpecEngine(target, draft_model, tok, **options)
        batch = engine.open_batch()
        engine.add(batch, prompts, SamplingParams(max_new_tokens=16 * (args.steps + 8), temperature=0.0))
        for _ in range(5):
            engine.step(batch)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step(batch)
            times.append(time.perf_counter() - start)
        out.append(f"{name} {statistics.median(times) * 1e3:.2f} ms")
        engine.close()
    print(f"{args.rows} rows x {args.length} tokens: " + " | ".join(out))


if __name__ == "__main__":
    main()
