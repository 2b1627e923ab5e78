"""What a lockstep cell is made of: the default policy's cycles by how it decided and what they did, beside plain
decoding, per round (`scripts/speed/engine_concurrency.py --lockstep`'s serving, one cell).

    python docs/bench/inprocess_s57/cycle_kinds.py [--concurrency 16] [--num-prompts 32] [--max-tokens 64]
                                                   [--temperature 0] [--rounds 2]

Per round: the drafting engine's tokens per second over plain decoding's, then per (decision, kind) its cycles,
rows per cycle, tokens committed, ms and tokens per ms; decision as `AdaptiveWidth.decision` ("plan", "kept",
"held", "probe", ...), kind "draft" (some row drafted), "copy" (one-token steps verifying prompt-lookup copies) or
"plain" (one-token steps only).

What this script does not know about: HTTP (`scripts/speed/serve_sweep.py`), other prompt sets than the held-out one.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, tokenizer, drafter = load_pair(None, None, "cpu", None)
    prompts = [tokenizer.encode(q.text) for q in load_prompts("default", args.num_prompts)]
    engines = {"plain": engine_concurrency.build_engine(target, tokenizer, drafter, None),
               "adaptive": engine_concurrency.build_engine(target, tokenizer, drafter, "adaptive")}
    for engine in engines.values():
        engine.warmup(args.concurrency)
        engine_concurrency.serve(engine, prompts[:args.concurrency], args.concurrency, 8, args.temperature)
    trace = []
    engines["adaptive"].cycle_trace = trace.append
    served = None
    for r in range(args.rounds):
        served = engine_concurrency.serve_lockstep(engines, prompts, args.concurrency,
                                                   [args.max_tokens] * len(prompts), args.temperature, served=served)
        kinds = defaultdict(lambda: [0, 0, 0.0, 0])  # cycles, tokens, ms, rows
        for c in trace:
            kind = "draft" if any(w > 1 for w in c["widths"]) else "copy" if c["lookups"] else "plain"
            k = kinds[(c["decision"], kind)]
            k[0] += 1
            k[1] += len(c["requests"]) + sum(c["accepted"])
            k[2] += c["ms"]
            k[3] += len(c["requests"])
        rate = {key: s.tokens / s.seconds for key, s in served.items()}
        print(f"round {r} (rounds so far): DFlash / plain decoding {rate['adaptive'] / rate['plain']:.3f}")
        for (decision, kind), (n, tokens, ms, rows) in sorted(kinds.items(), key=lambda x: -x[1][2]):
            print(f"  {decision:>10s} {kind:5s}: {n:3d} cycles, {rows / n:4.1f} rows, {tokens:5d} tokens, {ms:6.0f} ms, "
                  f"{tokens / ms:.2f} tokens/ms")
        trace.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
