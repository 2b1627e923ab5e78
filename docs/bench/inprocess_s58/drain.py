"""Where a lockstep cell's time goes, the drafting engine's cycles beside plain decoding's: full-batch one-token
steps, steps verifying prompt-lookup copies, cycles where requests joined, and the drain (cycles with fewer rows
than the concurrency, once requests stop arriving), from both engines' cycle traces.

    python docs/bench/inprocess_s58/drain.py [--concurrency 16] [--num-prompts 32] [--set default] [--temperature 0]
                                             [--trace]

Both engines serve the set's first NUM_PROMPTS prompts (64 new tokens each) at CONCURRENCY in lockstep
(`scripts/speed/engine_concurrency.py --lockstep`), two rounds; the tables are of the second. Plain decoding's
prefills are not cycles of its trace (its waves join in a prefill forward of their own), the drafting engine's
joins ride a cycle: the ratio printed first is the cell's, over everything. `--trace` prints every cycle.

What this script does not know about: HTTP (`scripts/speed/serve_sweep.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402


def kind(cycle: dict, concurrency: int) -> str:
    rows = len(cycle["requests"])
    drain = "" if rows >= concurrency - 2 else f" (< {concurrency - 2} rows)"
    if cycle["joined"]:
        return "join"
    if any(w > 1 for w in cycle["widths"]):
        return "draft" + drain
    return ("copy" if cycle["lookups"] else "one-token step") + drain


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--set", default="default")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--trace", action="store_true")
    args = p.parse_args(argv)
    target, tokenizer, drafter, prompts = engine_concurrency.shipped_pair(args.set, args.num_prompts)
    engines = {"plain": engine_concurrency.build_engine(target, tokenizer, drafter, None),
               "adaptive": engine_concurrency.build_engine(target, tokenizer, drafter, "adaptive")}
    traces = {name: [] for name in engines}
    for name, engine in engines.items():
        engine_concurrency.warm(engine, prompts, args.concurrency, args.temperature)
        engine.cycle_trace = traces[name].append
    served = None
    for _ in range(2):
        for trace in traces.values():
            trace.clear()
        served = engine_concurrency.serve_lockstep(engines, prompts, args.concurrency, [64] * len(prompts),
                                                   args.temperature, served=served)
    rate = {name: s.tokens / s.seconds for name, s in served.items()}
    print(f"DFlash / plain decoding {rate['adaptive'] / rate['plain']:.3f} (both rounds)")
    for name, trace in (("dflash", traces["adaptive"]), ("plain", traces["plain"])):
        kinds = engine_concurrency.tally_cycles(trace, lambda c: kind(c, args.concurrency))
        print(f"{name}: {sum(k[2] for k in kinds.values()):.0f} ms of cycles, {len(trace)} cycles")
        engine_concurrency.print_tally(kinds)
    if args.trace:
        for c in traces["adaptive"]:
            widths = "".join(f"{w - 1:x}" if w > 1 else "." for w in c["widths"])
            print(f"{c['decision']:>8s} rows {len(c['requests']):2d} joined {c['joined']} widths {widths} "
                  f"accepted {sum(c['accepted']):3d} lookups {c['lookups']} {c['ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
