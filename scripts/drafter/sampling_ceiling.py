"""The best tau a block drafter can reach at temperature T > 0, by what it knows of the tokens it drafted before.

    python scripts/drafter/sampling_ceiling.py [--target DIR] [--num 16] [--samples 128] [--temperature 1]
                                               [--orders 0[,1,2]] [--top-k K[,K]] [--threads 2]
                                               [--out runs/sampling_ceiling]

A DFlash-1 drafter proposes the whole block in one pass, so at block position i it knows the context and the bonus
token but not the tokens the target will sample at positions 1 .. i-1. The best it can learn there is the target's
marginal q_i(y) = E[p(y | context, x_1 .. x_{i-1})] over the target's own sampled continuations. Under the default
sampler (counter-based noise, `flashdraft/engine/noise.py`) its draft at position i is the winner of the race
argmax_y q_i(y) / E_i(y) with the noise E_i the target's sample at that position also uses, and the cycle keeps
drafts up to the first that differs from the target's sample. A drafter that walks the block (DFlash2's selector)
knows the tokens it drafted before position i, which equal the target's while the drafts are being accepted: the
best such drafter knowing the last N of them (`--orders N`) drafts from q_i conditioned on those N tokens.

This script computes those ceilings from the target alone: per prompt it samples `--samples` continuations of one
block with independent noise (one seed each), estimates every q_i as the average of the other continuations'
conditional distributions (leave one out, so a continuation never votes for itself; for N > 0 over the others
that sampled the same N tokens before i, backing off to fewer where none did), races each q_i against the
continuation's own noise and counts the accepted prefix. `--top-k K` adds each order restricted to its marginal's K
most probable tokens (a DFlash2 selector's candidates). tau = 1 + accepted drafts (the bonus token), as the engine
counts it; the mean over continuations is the prompt's ceiling. Reported per set (in-domain held-out prompts,
out-of-domain `ood-code` prompts, mid-line and newline endings) as min / p10 / median / mean over prompts, the mean
acceptance per block position, and how often the N tokens were shared (below 1, the estimate backed off: from
below); `ceiling.png` plots the means.

What this script does not know about: drafters (it measures what the best one could do) and timings.
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


def conditional_marginals(tokens: torch.Tensor, probs: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per continuation and position, the best drafter's distribution when it knows the last `order` tokens of the
    continuation before the position (0: none, the marginal): the average of the target's distributions there over
    the OTHER continuations that sampled the same tokens (leave one out), backing off to fewer tokens where no
    other continuation shares them. Returns the distributions [S, width, V] and, per position, the share of
    continuations whose estimate used all `order` tokens [width] (position 1 knows everything: its context is
    the prompt, the same in every continuation)."""
    samples, width, _ = probs.shape
    estimates = (probs.sum(0, keepdim=True) - probs) / (samples - 1)  # order 0: the marginal, leave one out
    full = torch.ones(width)
    for i in range(1, width):
        used = torch.zeros(samples, dtype=torch.bool)
        for known in range(1, min(order, i) + 1):
            _, group, counts = torch.unique(tokens[:, i - known:i], dim=0, return_inverse=True, return_counts=True)
            others = counts[group] - 1
            shared = others > 0
            if not shared.any():
                break
            sums = torch.zeros(len(counts), probs.shape[-1]).index_add_(0, group, probs[:, i])
            loo = (sums[group] - probs[:, i]) / others.clamp(min=1)[:, None]
            estimates[shared, i] = loo[shared]
            used = shared if known == min(order, i) else torch.zeros_like(used)
        full[i] = used.float().mean() if order else 1.0
    return estimates, full


def among_candidates(estimates: torch.Tensor, marginals: torch.Tensor, top_k: int) -> torch.Tensor:
    """`estimates` [S, width, V] restricted to each position's `top_k` most probable tokens under `marginals` (a
    DFlash2 selector's candidates) and renormalised; where they hold no mass, the marginal's there."""
    candidates = marginals.topk(top_k, dim=-1).indices
    kept = estimates.gather(-1, candidates)
    kept = torch.where(kept.sum(-1, keepdim=True) > 0, kept, marginals.gather(-1, candidates))
    return torch.zeros_like(estimates).scatter_(-1, candidates, kept / kept.sum(-1, keepdim=True))


def best_drafter_taus(tokens: torch.Tensor, probs: torch.Tensor, prompt_len: int, seed0: int,
                      variants: list[tuple[int, int | None]]) -> tuple[dict, dict]:
    """Per variant (order, top_k), per continuation: tau of the best drafter that knows `order` drafted tokens
    before each position (`conditional_marginals`; 0: the marginal drafter, DFlash-1's ceiling), choosing among its
    marginal's `top_k` tokens only if given (`among_candidates`: a DFlash2 selector's ceiling), raced with the
    continuation's noise; and per position, the fraction of continuations whose draft there matches (given the
    prefix matched). While every draft before a position matched, the drafted tokens it knows are the target's, so
    conditioning on the continuation's tokens is conditioning on the drafts. Returns {variant: (taus,
    per_position)} and {order: the share of positions 2.. whose estimate used all `order` tokens}; each order's
    estimates and the noise are computed once for all variants."""
    from flashdraft.engine.noise import exponential_noise, race

    samples, width, vocab = probs.shape
    seeds = torch.arange(seed0, seed0 + samples, device=probs.device)
    noise = exponential_noise(seeds, torch.full_like(seeds, prompt_len), width, vocab)
    estimates = {order: conditional_marginals(tokens, probs, order)
                 for order in {order for order, _ in variants} | ({0} if any(k for _, k in variants) else set())}
    out = {}
    for order, top_k in variants:
        drafts_from = estimates[order][0]
        if top_k is not None:
            drafts_from = among_candidates(drafts_from, estimates[0][0], top_k)
        match = (race(drafts_from, noise) == tokens).int()
        alive = torch.cat([torch.ones(samples, 1, dtype=torch.int32), match.cumprod(1)[:, :-1]], 1)
        out[order, top_k] = ((1 + match.cumprod(1).sum(1)).float().tolist(),
                             [(match[:, i] * alive[:, i]).sum().item() / max(alive[:, i].sum().item(), 1)
                              for i in range(width)])
    return out, {order: full[1:].mean().item() for order, (_, full) in estimates.items()}


def best_drafter_tau(tokens: torch.Tensor, probs: torch.Tensor, prompt_len: int, seed0: int,
                     order: int = 0, top_k: int | None = None) -> tuple[list, list]:
    """`best_drafter_taus` of one variant: (taus, per_position)."""
    return best_drafter_taus(tokens, probs, prompt_len, seed0, [(order, top_k)])[0][order, top_k]


def plot(results: dict, variants: list, args) -> None:
    """Mean tau per cell, one bar per (drafted tokens known, candidates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys(key.split("|")[0] + " | " + key.split("|")[1] for key in results))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(3.6 + 2.2 * len(cells), 4))
    for j, (order, k) in enumerate(variants):
        suffix = (f"|{order}" if order or k else "") + (f"|top{k}" if k else "")
        means = [results[cell.replace(" | ", "|") + suffix]["mean"] for cell in cells]
        ax.bar([i + (j - (len(variants) - 1) / 2) * width for i in range(len(cells))], means, width,
               label=f"knows {order} drafted, " + (f"top {k}" if k else "all tokens"))
    ax.set_xticks(range(len(cells)), cells)
    ax.set_ylabel("tau (mean over prompts)")
    ax.set_title(f"best drafter at T = {args.temperature:g}, block {args.block_size}, {args.samples} continuations")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(args.out / "ceiling.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target directory (default: the shipped pair's)")
    ap.add_argument("--num", type=int, default=16, help="prompts per set and ending")
    ap.add_argument("--samples", type=int, default=128, help="sampled continuations per prompt")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--orders", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                    help="drafted tokens the best drafter knows before each position, e.g. 0,1,2 (0: the marginal)")
    ap.add_argument("--top-k", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="also each order choosing among its marginal's K most probable tokens only, e.g. 8,64 "
                         "(a DFlash2 selector's candidates)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sampling_ceiling")
    args = ap.parse_args(argv)
    if not 0.0 < args.temperature <= 100.0:
        ap.error(f"--temperature {args.temperature}: use a value in (0, 100]")
    if args.samples < 2 or args.num < 1 or args.block_size < 2 or min(args.orders) < 0 \
            or min(args.top_k, default=1) < 1:
        ap.error("--samples >= 2, --num >= 1, --block-size >= 2, --orders >= 0 and --top-k >= 1")

    from tqdm import tqdm

    from flashdraft.loading import default_pair_paths, load_target

    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target or default_pair_paths()[0], "cpu", "float32")
    cells = {(name, ending): [tokenizer(p, add_special_tokens=False)["input_ids"]
                              for p in short_prompts(name, ending, args.num)]
             for name in ("in-domain", "ood") for ending in ENDINGS}
    results, lines = {}, [f"best drafter at T = {args.temperature:g}, block {args.block_size}, {args.samples} "
                          "continuations per prompt, knowing the last N drafted tokens (0: the marginal drafter): "
                          "tau per prompt min / p10 / median / mean; candidates: the tokens it chooses among (its "
                          "marginal's K most probable, or all)", "",
                          "| set | ending | N | candidates | tau | acceptance at positions 1 / 2 / 4 / 8 "
                          "| N tokens shared |",
                          "|---|---|---|---|---|---|---|"]
    variants = [(order, k) for order in args.orders for k in [None, *args.top_k]]
    bar = tqdm(total=sum(len(v) for v in cells.values()), desc="ceiling", unit="prompt", dynamic_ncols=True)
    for (name, ending), prompts in cells.items():
        prompt_taus = {v: [] for v in variants}
        positions = {v: [] for v in variants}
        shared = {order: [] for order in args.orders}
        for index, prompt in enumerate(prompts):
            seed0 = index * args.samples
            tokens, probs = continuation_probs(model, prompt, args.samples, args.block_size, args.temperature, seed0)
            by_variant, known = best_drafter_taus(tokens, probs, len(prompt), seed0, variants)
            for (order, k), (taus, per_position) in by_variant.items():
                prompt_taus[order, k].append(statistics.fmean(taus))
                positions[order, k].append(per_position)
            for order in args.orders:
                shared[order].append(known[order])
            bar.update(1)
        for order, k in variants:
            taus = prompt_taus[order, k]
            mean_positions = [statistics.fmean(p[i] for p in positions[order, k])
                              for i in range(args.block_size - 1)]
            r = {"min": min(taus), "p10": percentile(taus, 0.1), "median": statistics.median(taus),
                 "mean": statistics.fmean(taus), "per_prompt_tau": [round(t, 3) for t in taus],
                 "acceptance_by_position": [round(a, 3) for a in mean_positions],
                 "known_share": round(statistics.fmean(shared[order]), 3)}
            results[f"{name}|{ending}" + (f"|{order}" if order or k else "") + (f"|top{k}" if k else "")] = r
            shown = " / ".join(f"{mean_positions[i - 1]:.2f}" for i in (1, 2, 4, 8) if i <= len(mean_positions))
            lines.append(f"| {name} | {ending} | {order} | {k or 'all'} | {r['min']:.2f} / {r['p10']:.2f} / "
                         f"{r['median']:.2f} / **{r['mean']:.2f}** | {shown} | {r['known_share']:.2f} |")
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"temperature": args.temperature, "samples": args.samples, "block_size": args.block_size, "num": args.num,
         "orders": args.orders, "top_k": args.top_k, "cells": results}, indent=1))
    table = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(table)
    plot(results, variants, args)
    print(table)
    print(f"wrote {args.out}/results.json, results.md, ceiling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
