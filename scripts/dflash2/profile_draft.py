"""Where a DFlash2 draft step's time goes, against DFlash-1's: the proposer's draft step (`_draft_tokens`: context
write, block forward, read-out, choice of tokens) on the shipped pair's shapes, called directly (no engine loop),
so that the comparison is of the step alone and low in noise.

    python scripts/dflash2/profile_draft.py --threads 1 [--compile] [--iters 200] [--profile] [--temperature 1]
        [--confidence] [--selector-top-k 8192 [--walk-candidates K]] [--selector-rank R]
        [--dflash1 DIR --dflash2 DIR]     # two trained checkpoints, e.g. issue 16's pair's final drafters

Prints the median ms per step of each drafter (calls interleaved one by one) and their ratio, per round and the
median over rounds; `--profile` adds torch.profiler's table of operators (self CPU time) for each. The DFlash2
drafter is `draft_latency.dflash2_like` (the shipped DFlash-1 weights, identity convolutions, a random selector)
unless `--dflash1` / `--dflash2` name checkpoints to time instead (the shipped drafter stands for a DFlash-1 not
given). `--temperature` > 0 drafts through the gumbel race (the engine's default sampler) with uniform noise. `--confidence`: both drafters also report their
confidence in each draft, as they do under the default policy's confidence trim (eager only).

What this script does not know about: the engine's bookkeeping around a draft (`draft_latency.py` measures the
draft phase of real decoding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_latency import dflash2_like  # noqa: E402


def step_inputs(proposer, context: int, new: int, block_size: int, temperature: float):
    """A cache holding `context` positions, `new` fresh feature slots to write, a block after them, and the race's
    noise and 1/T for `temperature` > 0 (None at 0)."""
    drafter = proposer.drafter
    torch.manual_seed(0)
    width = len(drafter.target_layer_ids) * drafter.target_hidden_size
    kv = drafter.new_cache(1, 512)
    old = torch.arange(context - new)[None]
    drafter.write_context(kv, torch.randn(1, context - new, width), old, torch.ones_like(old, dtype=torch.bool))
    positions = torch.arange(context - new, context)[None]
    block = torch.full((1, block_size), drafter.mask_token_id, dtype=torch.long)
    block[:, 0] = 42
    args = (kv, torch.randn(1, new, width), positions, torch.ones_like(positions, dtype=torch.bool), block,
            torch.arange(context, context + block_size)[None], None if proposer.compiled else context + block_size)
    if temperature <= 0:
        return args + (None, None)
    noise = torch.empty(1, block_size - 1, int(drafter.config.vocab_size)).exponential_()
    return args + (noise, torch.full((1,), 1.0 / temperature))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--new", type=int, default=6, help="feature slots written per step (about tau + 1)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--confidence", action="store_true", help="drafts report their confidence (the trim's input)")
    ap.add_argument("--selector-top-k", type=int, default=None,
                    help="the DFlash2 selector's candidates (default: ours, 8; the vocabulary size: every token)")
    ap.add_argument("--selector-rank", type=int, default=None, help="the DFlash2 selector's rank (default: ours, 32)")
    ap.add_argument("--walk-candidates", type=int, default=None,
                    help="a whole-vocabulary selector walks among each position's K likeliest winners (default: "
                         "the engine's, 16; 0 = every token)")
    ap.add_argument("--dflash1", default=None, metavar="DIR", help="a DFlash-1 checkpoint (default: the shipped)")
    ap.add_argument("--dflash2", default=None, metavar="DIR",
                    help="a DFlash2 checkpoint (default: the shipped drafter grown into one, `dflash2_like`)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.dflash2 and (args.selector_top_k or args.selector_rank):
        ap.error("--selector-top-k / --selector-rank shape the stand-in DFlash2; a --dflash2 checkpoint has its own")
    torch.set_num_threads(args.threads)
    from flashdraft import SpecEngine
    from flashdraft.loading import load_pair

    target, tokenizer, dflash1 = load_pair(None, args.dflash1) if args.dflash1 else load_pair()
    dflash2 = (load_pair(None, args.dflash2)[2] if args.dflash2 else
               dflash2_like(dflash1, selector_top_k=args.selector_top_k, selector_rank=args.selector_rank))
    drafters = {"dflash": dflash1, "dflash2": dflash2}
    steps = {}
    for name, drafter in drafters.items():
        # the engine's own proposer (packed read-out as the engine decides)
        proposer = SpecEngine(target, drafter, tokenizer, compile=args.compile, draft_policy="fixed").proposer
        proposer.confidence = args.confidence and not args.compile
        if name == "dflash2" and args.walk_candidates is not None:
            proposer.walk_candidates = args.walk_candidates
        fn = proposer._draft_step if args.compile else proposer._draft_tokens
        inputs = step_inputs(proposer, args.context, args.new, drafter.block_size, args.temperature)
        with torch.inference_mode():
            for _ in range(5):
                fn(*inputs)
        steps[name] = (fn, inputs)
    # interleaved call by call (the order alternating), so that a shared machine's load hits both alike; a round's
    # figure is each drafter's median call
    rounds = {name: [] for name in steps}
    names = list(steps)
    with torch.inference_mode():
        for _ in range(args.rounds):
            times = {name: [] for name in names}
            for i in range(args.iters):
                for name in (names if i % 2 else names[::-1]):
                    fn, inputs = steps[name]
                    start = time.perf_counter()
                    fn(*inputs)
                    times[name].append(time.perf_counter() - start)
            for name in names:
                rounds[name].append(1e3 * statistics.median(times[name]))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, (fn, inputs) in steps.items():
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(50):
                        fn(*inputs)
                print(f"== {name}: top operators by self CPU time, 50 steps")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    ms = {name: statistics.median(v) for name, v in rounds.items()}
    out = {"threads": args.threads, "compile": args.compile, "temperature": args.temperature,
           "selector_top_k": args.selector_top_k, "selector_rank": args.selector_rank,
           "walk_candidates": args.walk_candidates, "dflash1": args.dflash1, "dflash2": args.dflash2,
           "confidence": args.confidence, "ms_per_step": ms,
           "rounds_ms": rounds, "ratio": ms["dflash2"] / ms["dflash"],
           "round_ratios": [b / a for a, b in zip(rounds["dflash"], rounds["dflash2"])]}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
