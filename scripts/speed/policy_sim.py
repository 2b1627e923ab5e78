"""The draft policy on a simulated machine: throughput against plain decoding, deterministic, in seconds.

    python scripts/speed/policy_sim.py [--seeds 3] [--cycles 3000] [--concurrency 1,4,16,32] [--whole-blocks]
        [--early 1.0] [--refill 0.24,0.12,0.1,0.06] [--spike 0.3,20]

Served comparisons (`serve_sweep.py`) are the truth but take half an hour and move 5-10 % between runs on a shared
CPU, which hides most policy changes. This drives `AdaptiveWidth` (the engine's default policy, unchanged) through a
continuous batch on a machine model instead:
- the machine: a cycle costs (step + per_token x (tokens verified - 1)) x noise + (draft_fixed + draft_per_row /
  block x positions drafted + context_token x pending positions written) x noise, where noise is log-normal (sigma 0.25)
  and 5 % of cycles take 3x (the OS preempted the process): the timings a busy 2-core machine gives. Positions
  drafted: drafting rows x the widest drafting row's width, as the eager engine drafts (or x the block with
  `--whole-blocks`, as compiled drafting graphs do; the policy then offers only one token and the block). The
  drafter first writes the drafting rows' pending context (a row's prompt, then its one-token steps), padded to
  the longest, timed apart as the engine times it. The defaults are roughly the shipped pair's cycles at 16 rows
  on this CPU (16 rows' plain step ~3.7 ms, a 256-token verify ~23 ms, a draft ~0.5 ms plus ~1 ms per row's
  block of 16, ~0.01 ms per pending position: 16 rows drafting on ~100-token prompts took 40 ms against 25 ms);
  at batch 1 the real verify costs more than this models, and a short draft accepts 1-3 % less than the same
  positions of a whole block's (not modelled);
- the requests: `concurrency` rows of 64 tokens after a prompt of 30-300, each replaced by a new one when it
  finishes; each request accepts every draft position with its own probability p, drawn uniformly from the set's
  range (in-domain 0.75-0.95, mixed 0.2-0.9, failing 0.0-0.5), or, in the bursty set, stretches of p 0.9 and of
  p 0.05 (a 10 % chance of switching every cycle: acceptance that changes along a request, so rows chosen for
  their estimates accept less than the estimates said); with `--early E`, a request's acceptance starts at E x p
  and reaches p over its first 16 output tokens (the shipped pair's first drafts accept far less than its later
  ones: its first cycle's mean acceptance length is 2.6 against 5.9 over whole held-out requests; ~0.7 fits);
- with `--refill F1,F2,..`, the i-th one-token cycle after a drafting cycle costs Fi steps more (the caches and
  clock refilling for the target: the shipped pair at 4 rows measured 0.24, 0.12, 0.1, 0.06 steps);
- with `--spike P,S`, a drafting cycle costs S steps more with chance P: new shapes whose kernels are planned
  first (on an H200 in bf16 the shipped pair's drafting cycles cost 10-45 one-token steps; cuDNN attention builds a
  graph per new shape);
- plain decoding: the same machine and requests with every width 1.
It prints tokens/s of the policy / tokens/s of plain decoding, the mean over seeds, per concurrency and set.

What this script does not know about: models, the engine's real overheads (Python, caches). It ranks policy
changes; it does not replace the served sweep.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashdraft.engine.policy import AcceptancePriors, AdaptiveWidth, CostModel, CycleTiming, width_choices  # noqa: E402

SETS = {"in-domain": (0.75, 0.95), "mixed": (0.2, 0.9), "failing": (0.0, 0.5), "bursty": (0.05, 0.9)}
BURSTY = {"bursty": 0.1}  # sets whose requests switch between the two ends of their range, with this chance a cycle


def simulate(concurrency: int, p_range: tuple[float, float], seed: int, cycles: int = 3000, plain: bool = False,
             step_s: float = 2.5e-3, per_token_s: float = 0.08e-3, draft_row_s: float = 1.0e-3,
             request_tokens: int = 64, block_size: int = 16, switch: float = 0.0,
             context_token_s: float = 0.01e-3, drafts_to_width: bool = True, draft_fixed_s: float = 0.5e-3,
             early: float = 1.0, early_tokens: int = 16, refill: tuple[float, ...] = (),
             spike: tuple[float, float] = (0.0, 0.0)) -> float:
    """Committed tokens per simulated second of `concurrency` rows under the policy (or plain decoding)."""
    rng = np.random.default_rng(seed)
    policy = AdaptiveWidth(block_size, CostModel(), ragged=True, priors=AcceptancePriors(block_size),
                           choices=width_choices(block_size) if drafts_to_width else (1, block_size),
                           drafts_to_width=drafts_to_width)

    def new_request() -> dict:
        p = rng.choice(p_range) if switch else rng.uniform(*p_range)
        return {"state": policy.new_row(), "p": p, "left": request_tokens, "pending": int(rng.integers(30, 300))}

    rows = [new_request() for _ in range(concurrency)]
    seconds = tokens = 0.0
    since = len(refill)  # one-token cycles since the last drafting cycle
    for _ in range(cycles):
        widths = [1] * len(rows) if plain else policy.widths([r["state"] for r in rows], [r["pending"] for r in rows])
        accepted = []
        for r, w in zip(rows, widths):
            if switch and rng.random() < switch:
                r["p"] = p_range[1] if r["p"] == p_range[0] else p_range[0]
            a = 0
            done = request_tokens - r["left"]  # output tokens so far: a request's first drafts accept less
            p = r["p"] * (early + (1.0 - early) * min(1.0, done / early_tokens))
            while a < w - 1 and rng.random() < p:
                a += 1
            accepted.append(a)
        verified, drafting = sum(widths), sum(w > 1 for w in widths)
        noise = rng.lognormal(0.0, 0.25) * (3.0 if rng.random() < 0.05 else 1.0)
        drafted = drafting * (max(widths) if drafts_to_width else block_size) if drafting else 0
        context = drafting * max((r["pending"] for r, w in zip(rows, widths) if w > 1), default=0)
        draft_s = (draft_fixed_s + draft_row_s / block_size * drafted) * noise if drafted else 0.0
        context_s = context_token_s * context * noise
        total_s = (step_s + per_token_s * (verified - 1)) * noise + draft_s + context_s
        if drafting and spike[0] and rng.random() < spike[0]:  # (no draw without spikes: the same runs as before)  # a new shape's kernels planned (cuDNN attention graphs on a GPU)
            total_s += spike[1] * step_s
        if not drafting and since < len(refill):  # the caches refill for the target after a drafting cycle
            total_s += refill[since] * step_s
        since = 0 if drafting else since + 1
        if not plain:
            policy.observe([r["state"] for r in rows], widths, accepted,
                           CycleTiming(verified, drafted, draft_s, total_s, context, context_s))
        seconds += total_s
        for i, (r, a) in enumerate(zip(rows, accepted)):
            committed = min(a + 1, r["left"])
            r["pending"] = a + 1 if widths[i] > 1 else r["pending"] + 1
            tokens += committed
            r["left"] -= committed
            if r["left"] <= 0:
                rows[i] = new_request()  # (policy.new_row: a row joined, the policy plans afresh)
    return tokens / seconds


def ratio(concurrency: int, name: str, seeds: int = 3, cycles: int = 3000, drafts_to_width: bool = True,
          early: float = 1.0, refill: tuple[float, ...] = (), spike: tuple[float, float] = (0.0, 0.0)) -> float:
    """Mean over seeds of the policy's throughput / plain decoding's, on the set `name`."""
    p, switch = SETS[name], BURSTY.get(name, 0.0)
    return float(np.mean([simulate(concurrency, p, s, cycles, switch=switch, drafts_to_width=drafts_to_width,
                                   early=early, refill=refill, spike=spike)
                          / simulate(concurrency, p, s, cycles, True, switch=switch) for s in range(seeds)]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=3000)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--whole-blocks", action="store_true",
                    help="every draft fills the whole block (compiled drafting graphs); widths 1 and the block")
    ap.add_argument("--early", type=float, default=1.0,
                    help="a request's acceptance at its first token, as a share of its own (1: flat)")
    ap.add_argument("--refill", default="",
                    help="comma-separated extra steps the one-token cycles after a drafting cycle cost (none)")
    ap.add_argument("--spike", default="0,0",
                    help="P,S: a drafting cycle costs S steps more with chance P (new shapes planned on a GPU)")
    args = ap.parse_args(argv)
    try:
        refill = tuple(float(x) for x in args.refill.split(",") if x.strip())
    except ValueError:
        ap.error(f"--refill: comma-separated numbers, got {args.refill!r}")
    try:
        spike = tuple(float(x) for x in args.spike.split(","))
    except ValueError:
        spike = ()
    if len(spike) != 2 or not 0.0 <= spike[0] <= 1.0 or spike[1] < 0:
        ap.error(f"--spike: P,S with P in [0, 1] and S >= 0, got {args.spike!r}")
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if args.seeds < 1 or args.cycles < 10 or not levels or min(levels) < 1 or not 0.0 <= args.early <= 1.0:
        ap.error("--seeds >= 1, --cycles >= 10, --concurrency: positive integers, --early in [0, 1]")
    print("policy throughput / plain decoding, simulated machine (scripts/speed/policy_sim.py)\n")
    print("| concurrency | " + " | ".join(SETS) + " |")
    print("|---|" + "---|" * len(SETS))
    for c in levels:
        cells = (ratio(c, name, args.seeds, args.cycles, not args.whole_blocks, args.early, refill, spike) for name in SETS)
        print(f"| {c} | " + " | ".join(f"{cell:.3f}" for cell in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
