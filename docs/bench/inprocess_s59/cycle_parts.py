"""Where one engine's time goes in an in-process cell: wall time inside the engine's cycle parts and the draft
policy's calls, timed by wrappers (perf_counter around each call; a profiler's per-call cost would inflate the
Python-heavy parts it is meant to weigh).

    python docs/bench/inprocess_s59/cycle_parts.py [--engine adaptive|never|fixed|plain] [--concurrency 16]
        [--temperature 0] [--num-prompts 64] [--max-tokens 64] [--rounds 2]

The engine is built, warmed up and served as `scripts/speed/engine_concurrency.py` does (the shipped pair, one
torch thread, the held-out prompts, `concurrency` requests in flight), alone: the shares are of its own wall time.
Parts nest (`_target_forward` and the policy's calls run inside `_cycle`; `worth_looking_up` inside
`_lookup_copies`); what is outside `_cycle` is mostly the prefill of prompts joining an empty batch (`_prefill`).

What this script does not know about: other engines in the same run (compare ratios with
`engine_concurrency.py --lockstep`), HTTP.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402

from flashdraft.engine import generate, policy  # noqa: E402

ENGINE_PARTS = ("_cycle", "_prefill", "_target_forward", "_propose", "_verify", "_commit_block", "_lookup_copies",
                "_noise", "_update_text")
POLICY_CALLS = ("widths", "trim", "observe", "worth_looking_up", "lookup_widths", "observe_lookups",
                "observe_searches")


def timed(cls, name: str, seconds: dict, calls: dict) -> None:
    """Wrap `cls.name` so every call adds its wall time to seconds[name]."""
    inner = getattr(cls, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - started
            calls[name] += 1

    setattr(cls, name, wrapper)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="adaptive", choices=("adaptive", "never", "fixed", "plain"))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    seconds, calls = defaultdict(float), defaultdict(int)
    for name in ENGINE_PARTS:
        timed(generate.SpecEngine, name, seconds, calls)
    for name in POLICY_CALLS:
        timed(policy.AdaptiveWidth, name, seconds, calls)
    target, tokenizer, drafter, prompts = engine_concurrency.shipped_pair("default", args.num_prompts)
    engine = engine_concurrency.build_engine(target, tokenizer, drafter, None if args.engine == "plain" else args.engine)
    engine_concurrency.warm(engine, prompts, args.concurrency, args.temperature)
    seconds.clear()
    calls.clear()
    started = time.perf_counter()
    for _ in range(args.rounds):
        engine_concurrency.serve(engine, prompts, args.concurrency, args.max_tokens, args.temperature)
    total = time.perf_counter() - started
    cycles = max(calls["_cycle"], 1)
    print(f"{args.engine}, {args.concurrency} requests, T = {args.temperature}: {total:.3f} s, {cycles} cycles")
    print("| part | ms | calls | us per call | us per cycle | share |\n|---|---|---|---|---|---|")
    for name in sorted(seconds, key=lambda k: -seconds[k]):
        s, n = seconds[name], calls[name]
        print(f"| {name} | {1e3 * s:.1f} | {n} | {1e6 * s / n:.1f} | {1e6 * s / cycles:.1f} | {100 * s / total:.2f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
