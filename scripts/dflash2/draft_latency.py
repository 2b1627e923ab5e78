"""Drafting latency of a DFlash2 drafter against the DFlash-1 drafter it grows from, on the shipped pair's shapes:
the engine's own draft phase per cycle (`CycleProfiler`, drafter forward + read-out + choice of tokens), batch 1.

    python scripts/dflash2/draft_latency.py --threads 1 [--compile] [--prompts 8] [--max-new-tokens 128]

The DFlash-1 drafter is the shipped one; the DFlash2 drafter has the same layers with the shipped weights copied
in, plus convolutions (the identity) and a selector (random) (`--selector-rank` / `--selector-top-k` /
`--conv-kernel-size` / `--conv-group-size`, default ours): latency does not depend on the values, and with weights
this close both draft similar blocks, so the two runs see similar cycles (compare the taus printed). The two
drafters alternate prompt by prompt (a shared machine's load hits both alike), for several rounds; the median over
rounds is reported, with the per-round ratios' median and spread (how noisy the machine was).

What this script does not know about: acceptance of a TRAINED DFlash2 drafter (that is training's measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def dflash2_like(drafter, **options):
    """A DFlash2 drafter with `drafter`'s layers and weights, identity convolutions and a random selector."""
    from flashdraft.model import DFlash2DraftModel
    from flashdraft.model.dflash2 import DEFAULT_DFLASH2

    config = drafter.config.__class__.from_dict(drafter.config.to_dict())
    config.dflash_config = {**config.dflash_config, **DEFAULT_DFLASH2,
                            **{k: v for k, v in options.items() if v is not None}}
    config.dflash_config["conv_group_size"] = min(config.dflash_config["conv_group_size"], config.hidden_size)
    config.architectures = ["DFlash2DraftModel"]
    torch.manual_seed(0)
    model = DFlash2DraftModel(config)
    model.load_state_dict(drafter.state_dict(), strict=False)  # convolutions stay the identity (same cost)
    return model.to(drafter.dtype).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    for flag in ("selector-rank", "selector-top-k", "conv-kernel-size", "conv-group-size"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from flashdraft import SamplingParams, SpecEngine
    from flashdraft.demo import load_heldout_prompts
    from flashdraft.loading import load_pair

    target, tokenizer, dflash1 = load_pair()
    dflash2 = dflash2_like(dflash1, selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                           conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in load_heldout_prompts(args.prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engines = {name: SpecEngine(target, d, tokenizer, compile=args.compile, profile=True, draft_policy="fixed")
               for name, d in (("dflash", dflash1), ("dflash2", dflash2))}
    for engine in engines.values():  # warm-up (and compile)
        engine.generate(prompts[:1], params)
    # interleaved prompt by prompt (the order alternating), so that a shared machine's load hits both alike; a
    # round's figure is each drafter's draft ms per cycle over all prompts
    rounds = {name: [] for name in engines}
    taus = {name: [] for name in engines}
    names = list(engines)
    for _ in range(args.rounds):
        draft_ms = dict.fromkeys(names, 0.0)
        cycles = dict.fromkeys(names, 0)
        for i, p in enumerate(prompts):
            for name in (names if i % 2 else names[::-1]):
                engine = engines[name]
                engine.profiler.reset()
                result = engine.generate([p], params)[0]
                report = engine.profiler.report()
                draft_ms[name] += report["ms_per_cycle"]["draft"] * report["cycles"]
                cycles[name] += report["cycles"]
                taus[name].append(result.stats.tau)
        for name in names:
            rounds[name].append(draft_ms[name] / max(cycles[name], 1))
    ratios = sorted(b / a for a, b in zip(rounds["dflash"], rounds["dflash2"]))
    out = {"threads": args.threads, "compile": args.compile, "prompts": len(prompts), "dtype": str(dflash1.dtype),
           "dflash2_config": {k: dflash2.config.dflash_config[k] for k in ("selector_rank", "selector_top_k",
                                                                          "conv_kernel_size", "conv_group_size")},
           "draft_ms_per_cycle": {n: statistics.median(v) for n, v in rounds.items()},
           "rounds_ms": rounds, "tau": {n: statistics.mean(v) for n, v in taus.items()}}
    out["ratio"] = out["draft_ms_per_cycle"]["dflash2"] / out["draft_ms_per_cycle"]["dflash"]
    # the noise: the per-round ratios' median and spread (a round pairs both drafters on the same prompts)
    out["round_ratios"] = {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
                           "quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios}
    for engine in engines.values():
        engine.close()
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
