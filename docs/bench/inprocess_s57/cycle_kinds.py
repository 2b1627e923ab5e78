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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    target, tokenizer, drafter, prompts = engine_concurrency.shipped_pair("default", args.num_prompts)
    engines = {"plain": engine_concurrency.build_engine(target, tokenizer, drafter, None),
               "adaptive": engine_concurrency.build_engine(target, tokenizer, drafter, "adaptive")}
    for engine in engines.values():
        engine_concurrency.warm(engine, prompts, args.concurrency, args.temperature)
    trace = []
    engines["adaptive"].cycle_trace = trace.append
    served = None
    for r in range(args.rounds):
        served = engine_concurrency.serve_lockstep(engines, prompts, args.concurrency,
                                                   [args.max_tokens] * len(prompts), args.temperature, served=served)
        kinds = engine_concurrency.tally_cycles(
            trace, lambda c: f"{c['decision']} " + ("draft" if any(w > 1 for w in c["widths"])
                                                   else "copy" if c["lookups"] else "plain"))
        rate = {key: s.tokens / s.seconds for key, s in served.items()}
        print(f"round {r} (rounds so far): DFlash / plain decoding {rate['adaptive'] / rate['plain']:.3f}")
        engine_concurrency.print_tally(kinds, order=lambda x: -x[1][2])
        trace.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
