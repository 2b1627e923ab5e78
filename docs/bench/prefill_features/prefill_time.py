"""What prefilling a wave of prompts costs the drafting engine against plain decoding: `SpecEngine.generate` of one
new token for the set's first N prompts at once (the prompts' forward, the first token, and for the drafting engine
the prompts' target features kept for the drafter), both engines alternating, median of the reps.

    python docs/bench/prefill_features/prefill_time.py [--set ood-code] [--num-prompts 64] [--reps 9]

Prints the median seconds of each and their ratio. Run two checkouts side by side with PYTHONPATH (the same file
times either: it uses the public engine API only).

What this script does not know about: prompts that join a running batch (they ride its cycle), decoding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from flashdraft.bench.datasets import load_prompts
from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.loading import load_pair


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="ood-code")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, tokenizer, drafter = load_pair(None, None, "cpu", None)
    prompts = [tokenizer.encode(q.text) for q in load_prompts(args.set, args.num_prompts)]
    engines = {"plain": SpecEngine(target, tokenizer=tokenizer), "dflash": SpecEngine(target, drafter, tokenizer=tokenizer)}
    params = [SamplingParams(max_new_tokens=1)] * len(prompts)
    times = {name: [] for name in engines}
    for rep in range(args.reps + 1):
        for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
            started = time.perf_counter()
            engines[name].generate(prompts, params)
            if rep:  # the first is a warm-up
                times[name].append(time.perf_counter() - started)
    median = {name: statistics.median(t) for name, t in times.items()}
    tokens = sum(map(len, prompts))
    print(f"{args.set}, {len(prompts)} prompts, {tokens} tokens: plain {median['plain'] * 1e3:.1f} ms, "
          f"dflash {median['dflash'] * 1e3:.1f} ms, dflash / plain {median['dflash'] / median['plain']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
