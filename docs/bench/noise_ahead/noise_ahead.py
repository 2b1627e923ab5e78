"""Sampled rows' noise hashed NOISE_AHEAD positions at a time against one window per cycle, side by side in one
process: plain decoding and the drafting engine (default policy) at temperature 1, the shipped pair, one thread.

    python docs/bench/noise_ahead/noise_ahead.py [--concurrency 1,4] [--num-prompts 32] [--max-tokens 64] [--rounds 3]

Per cell, every round serves the held-out prompts (seeded: request i has seed i) through each engine twice, with
`generate.NOISE_AHEAD_VALUES` set to 0 (every window hashed when it is needed, as before) and to its default,
in alternating order; prints tokens per second of each and the ratio ahead / per cycle, and checks that both
settings produced the same text (the noise of a position does not depend on when it was hashed).

What this script does not know about: HTTP, other sets of prompts, greedy rows (they have no noise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402

from flashdraft.engine import generate  # noqa: E402


def served(engine, prompts, concurrency: int, max_tokens: int, ahead_values: int) -> tuple[float, int, list]:
    """(seconds, tokens, texts) of serving `prompts` at temperature 1 with NOISE_AHEAD_VALUES = ahead_values."""
    default = generate.NOISE_AHEAD_VALUES
    generate.NOISE_AHEAD_VALUES = ahead_values
    finished = []
    try:
        tokens, seconds, _, _ = engine_concurrency.serve(engine, prompts, concurrency, max_tokens, 1.0, finished)
    finally:
        generate.NOISE_AHEAD_VALUES = default
    return seconds, tokens, sorted(tuple(r.token_ids) for r in finished)  # finishing order may differ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    target, tokenizer, drafter, prompts = engine_concurrency.shipped_pair("default", args.num_prompts)
    engines = {"plain decoding": engine_concurrency.build_engine(target, tokenizer, drafter, None),
               "dflash": engine_concurrency.build_engine(target, tokenizer, drafter, "adaptive")}
    settings = {"per cycle": 0, "ahead": generate.NOISE_AHEAD_VALUES}
    print("| engine | requests | ahead tok/s | per cycle tok/s | ahead / per cycle | rounds | same text |")
    print("|---|---|---|---|---|---|---|")
    for concurrency in map(int, args.concurrency.split(",")):
        for name, engine in engines.items():
            engine_concurrency.warm(engine, prompts, concurrency, 1.0)
            totals = {s: [0.0, 0] for s in settings}
            per_round, same = [], True
            for r in range(args.rounds):
                texts, rates = {}, {}
                for setting in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
                    seconds, tokens, texts[setting] = served(engine, prompts, concurrency, args.max_tokens,
                                                             settings[setting])
                    totals[setting][0] += seconds
                    totals[setting][1] += tokens
                    rates[setting] = tokens / seconds
                per_round.append(rates["ahead"] / rates["per cycle"])
                same &= texts["ahead"] == texts["per cycle"]
            rate = {s: tokens / seconds for s, (seconds, tokens) in totals.items()}
            print(f"| {name} | {concurrency} | {rate['ahead']:.1f} | {rate['per cycle']:.1f} | "
                  f"**{rate['ahead'] / rate['per cycle']:.3f}** | {' / '.join(f'{x:.3f}' for x in per_round)} | "
                  f"{'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
