"""What the lookup search costs and gives, per kind of row: the default policy against the same policy searching
every row its copy gate lets through (`SEARCH_PROBE_EVERY=1`, the behaviour before searches were priced by their
yield), serving the same queue in one process.

    python scripts/speed/lookup_searches.py [--concurrency 16] [--temperatures 1,0] [--rounds 2] [--num-prompts 32]

Per set, temperature, engine and round: prompt-lookup searches (`NgramIndex.continuation` calls), lookup steps
and accepted lookup tokens, drafting cycles, tokens/s, and the engine's learnt search yield per kind (accepted
lookup tokens per search; greedy `False`, sampled `True`) and seconds per searched row.

What this script does not know about: HTTP (`serve_sweep.py`), and speedups within this machine's noise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

from engine_concurrency import SETS, build_engine, policy_constants, serve  # noqa: E402

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.engine import lookup  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402

ENGINES = {"priced": {}, "every": {"SEARCH_PROBE_EVERY": 1}}


def count_searches() -> list[int]:
    """A counter of `NgramIndex.continuation` calls from now on (read and reset through the returned list)."""
    calls, continuation = [0], lookup.NgramIndex.continuation

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return continuation(self, *args, **kwargs)

    lookup.NgramIndex.continuation = counted
    return calls


def serve_counting(engine, prompts, concurrency: int, temperature: float) -> dict:
    """`engine_concurrency.serve` of the queue (64 tokens a request), with the requests' lookup and draft counts."""
    results = []
    tokens, seconds = serve(engine, prompts, concurrency, 64, temperature, results)[:2]
    return {"tokens": tokens, "tok_s": round(tokens / seconds),
            "lookup_steps": sum(r.stats.lookup_steps for r in results),
            "lookup_accepted": sum(r.stats.lookup_accepted for r in results),
            "drafts": sum(r.stats.num_drafts for r in results)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--temperatures", default="1,0")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per set")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        p.error(f"--temperatures: comma-separated numbers, got {args.temperatures!r}")
    if args.concurrency < 1 or args.rounds < 1 or args.num_prompts < 1 or min(temperatures) < 0:
        p.error("--concurrency, --rounds and --num-prompts must be >= 1, temperatures >= 0")
    torch.set_num_threads(args.threads)
    searches = count_searches()
    target, tokenizer, drafter = load_pair(None, None, "cpu")
    print("| T | set | engine | round | searches | lookup steps | lookup tokens accepted | drafts | tok/s | "
          "yield (greedy / sampled) | us per search |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for temperature in temperatures:
        for name, specs in SETS.items():
            prompts = [tokenizer.encode(q.text) for spec in specs
                       for q in load_prompts(spec, max(1, args.num_prompts // len(specs)))]
            for engine_name, constants in ENGINES.items():
                with policy_constants(constants):
                    engine = build_engine(target, tokenizer, drafter, "adaptive")
                    engine.warmup(args.concurrency)
                    for r in range(args.rounds):
                        searches[0] = 0
                        t = serve_counting(engine, prompts, args.concurrency, temperature)
                        y = engine.acceptance_priors.search_yield
                        print(f"| {temperature:g} | {name} | {engine_name} | {r} | {searches[0]} | {t['lookup_steps']} "
                              f"| {t['lookup_accepted']} | {t['drafts']} | {t['tok_s']} | {y[False]:.3f} / "
                              f"{y[True]:.3f} | {1e6 * (engine.costs.search_s or 0):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
