"""A draft policy replayed offline against every output position's acceptance: how far it is from the fixed block
and from a policy that knew every draft's outcome in advance.

    python scripts/speed/policy_replay.py collect --sets held-out,out-of-domain --num-prompts 8 \
        --out runs/acceptance_traces.json           # the shipped pair, greedy: ~2 min per 8 prompts on one core
    python scripts/speed/policy_replay.py replay runs/acceptance_traces.json [--step-ms 9 --draft-ms 7
        --per-token 0.048 --noise 0.15 --repeats 6] [--variant NAME:CONSTANT=VALUE[,...]]...

`collect`: for each prompt, the target's greedy answer (`--max-tokens`), then for EVERY position t of it the
acceptance length of a block drafted there (the first cycle of a fixed-block engine run on prompt + answer[:t];
a greedy run's text does not depend on where cycles start, so these are the outcomes any policy would meet).
`replay`: the default policy (`flashdraft.engine.policy`, with `--variant` constants set) drives one row through
each answer at batch 1, greedy, its costs timed by a model of this machine: a one-token step `--step-ms`, a
verify of w tokens `--step-ms` x (1 + `--per-token` x (w - 1)), a draft `--draft-ms` (each timing multiplied by
lognormal `--noise`, as a shared CPU's are; the time charged is the model's mean). Printed per set: plain
decoding / the fixed block / the policy / the best any policy could do (dynamic programming over the traces),
as speedups over plain decoding, and the policy against the fixed block. The defaults are this project's 2-core
EPYC in fp32 (a batch-1 drafting cycle ~2.5 one-token steps).

Deterministic at `--noise 0`: a policy change can be compared without a machine's drift, then confirmed in the
engine (`engine_concurrency.py --variant`), which only this script's acceptance model leaves out: acceptance at
narrower widths is the block's cut short, and the confidence trim is not replayed.

`policy_sim.py` runs the policy on batches whose acceptance it draws from models; this one replays one row at a
time through the outcomes the shipped pair actually gives, with the best possible beside.

What this script does not know about: batches of more than one row, sampling, lookup steps, trees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_concurrency import SETS, parse_variant, policy_constants, set_prompts  # noqa: E402

from flashdraft.engine import policy as policy_module  # noqa: E402

BLOCK = 16


def collect(sets: list[str], num_prompts: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """{set: [per answer, the acceptance length of a block drafted at each of its positions]}."""
    import torch
    from tqdm import tqdm

    from flashdraft import SamplingParams, SpecEngine
    from flashdraft.engine import EngineConfig
    from flashdraft.loading import load_pair

    torch.set_num_threads(1)
    target, tokenizer, drafter = load_pair(None, None, "cpu", None)
    engine = SpecEngine(target, drafter, tokenizer, EngineConfig(draft_policy="fixed"))
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    traces = {}
    for name in sets:
        traces[name] = []
        for prompt in tqdm(set_prompts(tokenizer, name, num_prompts), desc=name):
            answer = engine.generate([prompt], SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stop))[0]
            answer = answer.token_ids
            lengths = []
            for t in range(len(answer)):
                run = engine.generate([prompt + answer[:t]], SamplingParams(max_new_tokens=BLOCK, stop_token_ids=stop))[0]
                # where a near-tie of fp32 arithmetic continues differently from this context, count what matched
                agree = next((k for k, (a, b) in enumerate(zip(run.token_ids, answer[t:])) if a != b), BLOCK)
                lengths.append(min(agree + 1, run.stats.acceptance_lengths[0]) if run.stats.acceptance_lengths else 1)
            traces[name].append(lengths)
    return traces


def fixed_cost(lengths: list[int], cycle: float) -> float:
    t = cost = 0
    while t < len(lengths):
        cost, t = cost + cycle, t + lengths[t]
    return cost


def best_cost(lengths: list[int], step: float, cycle: float) -> float:
    """The cheapest mix of one-token steps and full-block cycles, knowing every outcome."""
    best = [0.0] * (len(lengths) + 1)
    for t in range(len(lengths) - 1, -1, -1):
        best[t] = min(step + best[t + 1], cycle + best[min(len(lengths), t + lengths[t])])
    return best[0]


def replay_policy(traces: list[list[int]], step: float, per_token: float, draft: float, noise: float,
                  rng: np.random.Generator) -> tuple[float, int, int]:
    """(seconds, drafting cycles, one-token steps) of the default policy over the answers, one row at a time
    with one engine's costs and priors, as `SpecEngine.warmup(1)` leaves them at the start."""
    P = policy_module
    costs, priors = P.CostModel(), P.AcceptancePriors(BLOCK)
    policy = P.new_policy("adaptive", BLOCK, costs, True, priors)

    def verify(w: int) -> float:
        return step * (1 + per_token * (w - 1))

    def timing(w: int) -> P.CycleTiming:
        jitter = rng.lognormal(0, noise, 2) if noise else (1.0, 1.0)
        d = draft * jitter[1] if w > 1 else 0.0
        return P.CycleTiming(w, BLOCK if w > 1 else 0, d, verify(w) * jitter[0] + d)

    for _ in range(P.SETTLED + 2):
        for w in P.width_choices(BLOCK):
            costs.record(timing(w))
    seconds, cycles, steps = 0.0, 0, 0
    for lengths in traces:
        row, t = policy.new_row(False), 0
        while t < len(lengths):
            w = policy.widths([row], [0])[0]
            committed = min(lengths[t], w) if w > 1 else 1
            policy.observe([row], [w], [committed - 1], timing(w))
            seconds += verify(w) + (draft if w > 1 else 0.0)
            cycles, steps = cycles + (w > 1), steps + (w == 1)
            t += committed
    return seconds, cycles, steps


def replay(traces: dict[str, list[list[int]]], args, variants: list[tuple[str, dict]]) -> dict:
    step, draft = args.step_ms / 1e3, args.draft_ms / 1e3
    cycle = step * (1 + args.per_token * (BLOCK - 1)) + draft
    report = {}
    for name, answers in traces.items():
        plain = sum(len(a) for a in answers) * step
        fixed = sum(fixed_cost(a, cycle) for a in answers)
        best = sum(best_cost(a, step, cycle) for a in answers)
        row = {"plain": 1.0, "fixed": plain / fixed, "best": plain / best}
        for label, constants in variants:
            with policy_constants(constants):
                runs = [replay_policy(answers, step, args.per_token, draft, args.noise, np.random.default_rng(seed))
                        for seed in range(args.repeats if args.noise else 1)]
            seconds = float(np.mean([r[0] for r in runs]))
            row[label] = plain / seconds
            row[f"{label}_vs_fixed"] = fixed / seconds
            row[f"{label}_cycles_steps"] = [runs[0][1], runs[0][2]]
        report[name] = row
        print(f"{name}: {len(answers)} answers, plain 1.00x, fixed {row['fixed']:.2f}x, best possible "
              f"{row['best']:.2f}x | " + " | ".join(
                  f"{label} {row[label]:.2f}x ({row[f'{label}_vs_fixed']:.3f} of fixed; cycles / steps "
                  f"{row[f'{label}_cycles_steps'][0]} / {row[f'{label}_cycles_steps'][1]})" for label, _ in variants))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="every answer position's acceptance length on the shipped pair")
    c.add_argument("--sets", default=",".join(SETS), help=f"among {list(SETS)}")
    c.add_argument("--num-prompts", type=int, default=8, help="per set")
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="the default policy against the fixed block over collected traces")
    r.add_argument("traces")
    r.add_argument("--step-ms", type=float, default=9.0, help="a batch-1 one-token step")
    r.add_argument("--draft-ms", type=float, default=7.0, help="a batch-1 draft of one block")
    r.add_argument("--per-token", type=float, default=0.048, help="a verify's cost per extra token, in steps")
    r.add_argument("--noise", type=float, default=0.0, help="lognormal sigma of every timing the policy sees")
    r.add_argument("--repeats", type=int, default=6, help="seeds averaged when --noise > 0")
    r.add_argument("--variant", action="append", default=[], help="NAME:CONSTANT=VALUE[,...] (policy constants)")
    r.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.command == "collect":
        sets = args.sets.split(",")
        unknown = [s for s in sets if s not in SETS]
        if unknown or args.num_prompts < 1 or args.max_tokens < 1:
            p.error(f"--sets among {list(SETS)} (got {unknown}); --num-prompts and --max-tokens >= 1")
        traces = collect(sets, args.num_prompts, args.max_tokens)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(traces))
        print(f"wrote {args.out}")
        return 0
    if min(args.step_ms, args.draft_ms) <= 0 or args.per_token < 0 or args.noise < 0 or args.repeats < 1:
        p.error("--step-ms and --draft-ms > 0, --per-token and --noise >= 0, --repeats >= 1")
    try:
        traces = json.loads(Path(args.traces).read_text())
        variants = [("default", {})] + [parse_variant(v) for v in args.variant]
    except (OSError, ValueError) as e:
        p.error(str(e))
    if not isinstance(traces, dict) or not all(isinstance(a, list) and a for a in traces.values()):
        p.error(f"{args.traces}: expected {{set: [[acceptance length per position], ...]}} from `collect`")
    report = replay(traces, args, variants)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "sets": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
