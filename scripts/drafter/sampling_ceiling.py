"""The best tau any block drafter that drafts from per-position marginals can reach at temperature T > 0.

    python scripts/drafter/sampling_ceiling.py [--target DIR] [--num 16] [--samples 128] [--temperature 1]
                                               [--threads 2] [--out runs/sampling_ceiling]

A DFlash-1 drafter proposes the whole block in one pass, so at block position i it knows the context and the bonus
token but not the tokens the target will sample at positions 1 .. i-1. The best it can learn there is the target's
marginal q_i(y) = E[p(y | context, x_1 .. x_{i-1})] over the target's own sampled continuations. Under the default
sampler (counter-based noise, `flashdraft/engine/noise.py`) its draft at position i is the winner of the race
argmax_y q_i(y) / E_i(y) with the noise E_i the target's sample at that position also uses, and the cycle keeps
drafts up to the first that differs from the target's sample.

This script computes that ceiling from the target alone: per prompt it samples `--samples` continuations of one
block with independent noise (one seed each), estimates every q_i as the average of the other continuations'
conditional distributions (leave one out, so a continuation never votes for itself), races each q_i against the
continuation's own noise and counts the accepted prefix. tau = 1 + accepted drafts (the bonus token), as the engine
counts it; the mean over continuations is the prompt's ceiling. Reported per set (in-domain held-out prompts,
out-of-domain `ood-code` prompts, mid-line and newline endings) as min / p10 / median / mean over prompts, and the
mean acceptance per block position.

What this script does not know about: drafters (it measures what the best one could do) and timings. A drafter
that conditions each position on the tokens it drafted before (DFlash2's selector walks with the same noise) is not
bound by this ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.drafter.eval_tau import ENDINGS, percentile, short_prompts  # noqa: E402


@torch.no_grad()
def continuation_probs(model, prompt: list[int], samples: int, block: int, temperature: float, seed0: int):
    """Sampled continuations x [S, block - 1] (race winners under seeds seed0 .. seed0 + S - 1) and the target's
    distribution at every position given the prompt and the continuation so far, probs [S, block - 1, V]."""
    from flashdraft.engine.noise import exponential_noise, race

    device = next(model.parameters()).device
    ids = torch.tensor([prompt] * samples, device=device)
    seeds = torch.arange(seed0, seed0 + samples, device=device)
    out = model(ids, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    tokens, probs = [], []
    for i in range(block - 1):
        p = torch.softmax(logits.float() / temperature, dim=-1)
        noise = exponential_noise(seeds, torch.full_like(seeds, len(prompt) + i), 1, p.shape[-1])[:, 0]
        x = race(p, noise)
        tokens.append(x)
        probs.append(p)
        out = model(x[:, None], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(probs, 1)


def marginal_race_tau(tokens: torch.Tensor, probs: torch.Tensor, prompt_len: int, seed0: int) -> tuple[list, list]:
    """Per continuation: tau of the best marginal drafter (leave-one-out marginals raced with the continuation's
    noise); and per position, the fraction of continuations whose draft there matches (given the prefix matched)."""
    from flashdraft.engine.noise import exponential_noise, race

    samples, width, vocab = probs.shape
    total = probs.sum(0, keepdim=True)
    marginals = (total - probs) / (samples - 1)  # [S, width, V] leave one out
    seeds = torch.arange(seed0, seed0 + samples, device=probs.device)
    noise = exponential_noise(seeds, torch.full_like(seeds, prompt_len), width, vocab)
    drafts = race(marginals, noise)
    match = (drafts == tokens).int()
    accepted = match.cumprod(1).sum(1)
    taus = (1 + accepted).float().tolist()
    alive = torch.cat([torch.ones(samples, 1, dtype=torch.int32), match.cumprod(1)[:, :-1]], 1)
    per_position = [(match[:, i] * alive[:, i]).sum().item() / max(alive[:, i].sum().item(), 1) for i in range(width)]
    return taus, per_position


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target directory (default: the shipped pair's)")
    ap.add_argument("--num", type=int, default=16, help="prompts per set and ending")
    ap.add_argument("--samples", type=int, default=128, help="sampled continuations per prompt")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sampling_ceiling")
    args = ap.parse_args(argv)
    if not 0.0 < args.temperature <= 100.0:
        ap.error(f"--temperature {args.temperature}: use a value in (0, 100]")
    if args.samples < 2 or args.num < 1 or args.block_size < 2:
        ap.error("--samples >= 2, --num >= 1 and --block-size >= 2")

    from tqdm import tqdm

    from flashdraft.loading import default_pair_paths, load_target

    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target or default_pair_paths()[0], "cpu", "float32")
    cells = {(name, ending): [tokenizer(p, add_special_tokens=False)["input_ids"]
                              for p in short_prompts(name, ending, args.num)]
             for name in ("in-domain", "ood") for ending in ENDINGS}
    results, lines = {}, [f"best marginal drafter at T = {args.temperature:g}, block {args.block_size}, "
                          f"{args.samples} continuations per prompt: tau per prompt min / p10 / median / mean", "",
                          "| set | ending | tau | acceptance at positions 1 / 2 / 4 / 8 |", "|---|---|---|---|"]
    bar = tqdm(total=sum(len(v) for v in cells.values()), desc="ceiling", unit="prompt", dynamic_ncols=True)
    for (name, ending), prompts in cells.items():
        prompt_taus, positions = [], []
        for index, prompt in enumerate(prompts):
            seed0 = index * args.samples
            tokens, probs = continuation_probs(model, prompt, args.samples, args.block_size, args.temperature, seed0)
            taus, per_position = marginal_race_tau(tokens, probs, len(prompt), seed0)
            prompt_taus.append(statistics.fmean(taus))
            positions.append(per_position)
            bar.update(1)
        mean_positions = [statistics.fmean(p[i] for p in positions) for i in range(args.block_size - 1)]
        r = {"min": min(prompt_taus), "p10": percentile(prompt_taus, 0.1), "median": statistics.median(prompt_taus),
             "mean": statistics.fmean(prompt_taus), "per_prompt_tau": [round(t, 3) for t in prompt_taus],
             "acceptance_by_position": [round(a, 3) for a in mean_positions]}
        results[f"{name}|{ending}"] = r
        shown = " / ".join(f"{mean_positions[i - 1]:.2f}" for i in (1, 2, 4, 8) if i <= len(mean_positions))
        lines.append(f"| {name} | {ending} | {r['min']:.2f} / {r['p10']:.2f} / {r['median']:.2f} / "
                     f"**{r['mean']:.2f}** | {shown} |")
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"temperature": args.temperature, "samples": args.samples, "block_size": args.block_size, "num": args.num,
         "cells": results}, indent=1))
    table = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(table)
    print(table)
    print(f"wrote {args.out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
