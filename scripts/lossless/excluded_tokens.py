"""Does the sampler ever commit a token the target's distribution excludes?

Under top-k / top-p, and at a low temperature where probabilities underflow to zero, most of the vocabulary has
probability exactly 0 at every position; the default sampler (the exponential race under counter-based noise) must
never commit one of those. This script samples seeded requests through the engine (plain decoding and DFlash, the
shipped pair), then reads every committed token's probability off the target's own teacher-forced forward over
prompt + output (transformers' model, not our engine) under the request's temperature / top-k / top-p, and counts
tokens of probability 0.

    python scripts/lossless/excluded_tokens.py [--num-prompts 64] [--max-new-tokens 128] [--json ...]

Before the fix of the noise's top draw (its noise was -0.0, and 0 / -0 is NaN, the maximum to argmax) a token of
probability zero won at about 1 position in 2^24 / V (1 in ~2,000 at V = 8192).

What this script does not know about: whether the sampled distribution is the target's (the chi-square tests in
tests/test_sampling.py), rejection sampling (`--sampler rejection` draws from p itself).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.engine.verify import target_probs  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402

SETTINGS = {"top-k 20": dict(temperature=1.0, top_k=20), "top-p 0.5": dict(temperature=1.0, top_p=0.5),
            "T 0.1": dict(temperature=0.1)}


def excluded(target, prompt: list[int], output: list[int], params: SamplingParams) -> int:
    """How many of `output`'s tokens have probability 0 under the target's distribution at their position."""
    ids = torch.tensor([prompt + output])
    logits = target.lm_head(target.model(ids).last_hidden_state[0, len(prompt) - 1:-1])
    probs = target_probs(logits, params.temperature, params.top_p, params.top_k, params.min_p)
    return int((probs.gather(1, torch.tensor(output)[:, None]) == 0).sum())


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--num-prompts and --max-new-tokens must be >= 1")
    target, tokenizer, drafter = load_pair()
    prompts = [tokenizer.encode(p.text) for p in load_prompts("default", args.num_prompts)]
    engines = {"plain decoding": SpecEngine(target, None, tokenizer), "DFlash": SpecEngine(target, drafter, tokenizer)}
    rows = []
    print("| setting | engine | tokens | probability-0 tokens |\n|---|---|---|---|")
    for setting, options in SETTINGS.items():
        params = [SamplingParams(max_new_tokens=args.max_new_tokens, seed=i, **options) for i in range(len(prompts))]
        for name, engine in engines.items():
            results = engine.generate(prompts, params)
            bad = sum(excluded(target, p, r.token_ids, q) for p, r, q in
                      tqdm(list(zip(prompts, results, params)), desc=f"{setting}, {name}", leave=False))
            tokens = sum(len(r.token_ids) for r in results)
            rows.append({"setting": setting, "engine": name, "tokens": tokens, "excluded": bad})
            print(f"| {setting} | {name} | {tokens} | {bad} |", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0 if all(r["excluded"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
