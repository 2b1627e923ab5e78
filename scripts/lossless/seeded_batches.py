"""Does a seeded sampled request give the same text alone, in a busy batch, and under plain decoding?

For each held-out prompt of the shipped pair, temperature `--temperature` (1), seed = the prompt's index: plain
decoding alone (the reference), then DFlash alone and DFlash with the request placed among `--batch - 1` other
requests (other prompts, other seeds, a greedy one), for each sampler, in the default mode and in exact mode.
Counts the requests whose text equals the reference, and reports tau per configuration. Low temperatures
magnify rounding: the race compares p / E, and p = softmax(logits / T) scales a logit's rounding difference by 1 / T.

    python scripts/lossless/seeded_batches.py [--temperature 1] --json runs/seeded_batches.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft import SamplingParams, SpecEngine
from flashdraft.demo import load_heldout_prompts
from flashdraft.loading import load_pair


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0, help="of the seeded request (> 0)")
    p.add_argument("--configs", default="gumbel,rejection,gumbel-exact,rejection-exact",
                   help="comma-separated sampler[-exact] configurations to run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not 0 < args.temperature <= 100:
        p.error("--temperature must be in (0, 100]")
    torch.set_num_threads(args.threads)
    target, tok, drafter = load_pair(None, None, "cpu", "auto", "auto")
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in load_heldout_prompts(args.num_prompts)]
    rng = random.Random(0)

    def params(i, temperature=None):
        temperature = args.temperature if temperature is None else temperature
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=i)

    results = {"num_prompts": len(prompts), "batch": args.batch, "temperature": args.temperature,
               "drafter_dtype": str(drafter.dtype),
               "target_dtype": str(target.dtype), "configs": {}}
    for name in args.configs.split(","):
        sampler, exact = name.removesuffix("-exact"), name.endswith("-exact")
        plain = SpecEngine(target, None, tok, sampler=sampler, exact=exact)
        spec = SpecEngine(target, drafter, tok, sampler=sampler, exact=exact)
        counts = {"dflash alone = plain": 0, "dflash in batch = plain": 0, "plain in batch = plain": 0}
        drafts = accepted = 0
        for i, ids in enumerate(tqdm(prompts, desc=name, unit="prompt")):
            ref = plain.generate([ids], params(i))[0].token_ids
            alone = spec.generate([ids], params(i))[0]
            others = rng.sample(range(len(prompts)), args.batch - 1)
            batch_prompts = [prompts[j] for j in others[:-1]] + [ids, prompts[others[-1]]]
            batch_params = [params(1000 + j) for j in others[:-1]] + [params(i), params(0, temperature=0.0)]
            spot = args.batch - 2
            in_batch = spec.generate(batch_prompts, batch_params)[spot]
            plain_batch = plain.generate(batch_prompts, batch_params)[spot]
            counts["dflash alone = plain"] += alone.token_ids == ref
            counts["dflash in batch = plain"] += in_batch.token_ids == ref
            counts["plain in batch = plain"] += plain_batch.token_ids == ref
            drafts += alone.stats.num_drafts
            accepted += alone.stats.num_accepted_tokens
        results["configs"][name] = {**counts, "tau_alone": 1 + accepted / max(drafts, 1)}
        print(name, results["configs"][name])
        if args.json:  # after each configuration, so a long run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
