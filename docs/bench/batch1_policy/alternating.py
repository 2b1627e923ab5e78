"""Batch 1, greedy: the default draft policy against the fixed block, prompt by prompt, in one process.

    python docs/bench/batch1_policy/alternating.py [--num 64] [--rounds 1] [--set CONSTANT=VALUE ...] [--busy]
                                                   [--json FILE]

Both engines are built as `flashdraft demo --threads 1 [--draft-policy fixed]` builds them (the shipped pair, warmed
up with `SpecEngine.warmup(1)`), and each held-out prompt runs through one and then the other (the order alternating
prompt by prompt), up to 128 new tokens: the way the demo runs them, each engine's cycles back to back.
`--set CONSTANT=VALUE` sets a constant of `flashdraft/engine/policy.py` first (e.g. `--set SMOOTHING=0.15`);
`--busy`: a process spinning on another core meanwhile (as `serve_sweep.py`'s busy cell).
Prints the ratio of the two engines' tokens per second and where the default policy's time went beside the fixed
block's: prompts with and without one-token steps, and for prompts of as many cycles under both, the time per cycle.

What this script does not know about: served traffic (`scripts/speed/serve_sweep.py`), loads above one request
(`scripts/speed/engine_concurrency.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

from serve_sweep import busy_core  # noqa: E402

from flashdraft.args import apply_threads, engine_from_args, load_models  # noqa: E402
from flashdraft.cli import build_parser  # noqa: E402
from flashdraft.demo import load_heldout_prompts  # noqa: E402
from flashdraft.engine import SamplingParams  # noqa: E402
from flashdraft.engine import policy as policy_module  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="CONSTANT=VALUE")
    p.add_argument("--busy", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(policy_module, name):
            p.error(f"--set: flashdraft.engine.policy has no {name}")
        setattr(policy_module, name, type(getattr(policy_module, name))(float(value)))
    engines, models = {}, None
    for policy in ("adaptive", "fixed"):
        demo_args = build_parser().parse_args(["demo", "--threads", "1", "--draft-policy", policy])
        apply_threads(demo_args)
        models = models or load_models(demo_args, "")
        target, tokenizer, drafter = models
        engines[policy] = engine_from_args(demo_args, target, drafter, tokenizer)
        engines[policy].warmup(1)
    tokenizer = models[1]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in load_heldout_prompts(args.num)]
    params = SamplingParams(max_new_tokens=128, stop_token_ids=(tokenizer.eos_token_id,))
    for engine in engines.values():
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=8))
    per_prompt = []
    with busy_core(args.busy):
        for r in range(args.rounds):
            for i, ids in enumerate(prompts):
                row = {"prompt": i, "round": r}
                for key in ("adaptive", "fixed") if (i + r) % 2 == 0 else ("fixed", "adaptive"):
                    trace = []
                    engines[key].cycle_trace = trace.append
                    started = time.perf_counter()
                    out = engines[key].generate([ids], params)[0]
                    row[key] = {"s": time.perf_counter() - started, "tokens": len(out.token_ids),
                                "tau": round(out.stats.tau, 3), "cycles": len(trace),
                                "one_token_steps": sum(1 for c in trace if c["widths"][0] == 1)}
                    engines[key].cycle_trace = None
                per_prompt.append(row)
    rate = {k: sum(x[k]["tokens"] for x in per_prompt) / sum(x[k]["s"] for x in per_prompt) for k in engines}
    print(f"default policy / fixed block: {rate['adaptive'] / rate['fixed']:.3f} ({rate['adaptive']:.1f} against "
          f"{rate['fixed']:.1f} tok/s, {len(per_prompt)} prompt runs{', busy core' if args.busy else ''}"
          f"{', ' + ' '.join(args.set) if args.set else ''})")

    def part(rows, label):
        extra = sum(x["adaptive"]["s"] - x["fixed"]["s"] for x in rows)
        cycles = [sum(x[k]["cycles"] for x in rows) for k in ("adaptive", "fixed")]
        print(f"  {label}: {len(rows)} prompts, {1000 * extra:+.0f} ms, cycles {cycles[0]} against {cycles[1]}")

    part([x for x in per_prompt if x["adaptive"]["one_token_steps"]], "with one-token steps")
    part([x for x in per_prompt if not x["adaptive"]["one_token_steps"]], "without one-token steps")
    same = [x for x in per_prompt if x["adaptive"]["cycles"] == x["fixed"]["cycles"]]
    if same:
        per_cycle = [1000 * sum(x[k]["s"] for x in same) / sum(x[k]["cycles"] for x in same) for k in engines]
        print(f"  as many cycles under both: {len(same)} prompts, {per_cycle[0]:.2f} against {per_cycle[1]:.2f} "
              f"ms per cycle")
    if args.json:
        Path(args.json).write_text(json.dumps({"sets": args.set, "busy": args.busy, "rates": rate,
                                               "prompts": per_prompt}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
