"""How well a DFlash2 drafter's per-position confidence predicts acceptance: expected calibration error (ECE) of the
selector's and of the marginal's probability of each drafted token, on held-out prompts.

    python scripts/dflash2/calibration.py --target DIR --draft DFLASH2_DIR --prompts held_out.jsonl \
        [--limit 64] [--max-new-tokens 64] [--temperature 0] [--json runs/dflash2/calibration.json] \
        [--plot runs/dflash2/calibration.png] [--threads 1]

Each prompt runs alone (batch 1) through `SpecEngine` with `DFlash2Proposer(confidence=True)`, so the k-th
proposal of a request is its k-th cycle. The event scored is the one a draft-length policy needs: draft i is
accepted GIVEN that drafts 1 .. i-1 were (positions past the first rejection are never seen by the verifier and are
not scored). ECE: 10 equal-width confidence bins, sum over bins of |mean confidence - acceptance rate| weighted by
the bin's share of events. Also reported: the mean confidence and acceptance rate, and the Brier score.

What this script does not know about: policies (nothing here changes what is drafted).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def reliability(confidence: torch.Tensor, accepted: torch.Tensor, bins: int = 10) -> dict:
    """ECE, Brier score and per-bin (mean confidence, acceptance rate, count) of events (confidence, accepted)."""
    edges = torch.linspace(0, 1, bins + 1)
    index = torch.bucketize(confidence.clamp(0, 1), edges[1:-1])
    rows, ece = [], 0.0
    for b in range(bins):
        inside = index == b
        n = int(inside.sum())
        if n:
            conf, rate = float(confidence[inside].mean()), float(accepted[inside].float().mean())
            ece += abs(conf - rate) * n / len(confidence)
            rows.append({"bin": [round(float(edges[b]), 2), round(float(edges[b + 1]), 2)], "confidence": conf,
                         "acceptance": rate, "count": n})
    brier = float(((confidence - accepted.float()) ** 2).mean())
    return {"ece": ece, "brier": brier, "mean_confidence": float(confidence.mean()),
            "acceptance_rate": float(accepted.float().mean()), "events": len(confidence), "bins": rows}


def collect(engine, prompts, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    """(selector confidence, marginal confidence, accepted) of every scored draft, and tau per prompt."""
    proposer = engine.proposer
    seen: list = []
    original = proposer.propose

    def recording(state, inp, block_size):
        out = original(state, inp, block_size)
        seen.append(proposer.last_confidence)
        return out

    proposer.propose = recording
    selector, marginal, accepted, taus = [], [], [], []
    try:
        for prompt in prompts:
            seen.clear()
            stats = engine.generate([prompt], params)[0].stats
            taus.append(stats.tau)
            for conf, length in zip(seen, stats.acceptance_lengths):
                scored = min(length, conf.selector.shape[1])  # accepted drafts, then the first rejected one
                selector.append(conf.selector[0, :scored].float().cpu())
                marginal.append(conf.marginal[0, :scored].float().cpu())
                accepted.append(torch.arange(scored) < length - 1)
    finally:
        proposer.propose = original
    return torch.cat(selector), torch.cat(marginal), torch.cat(accepted), taus


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for name in ("selector", "marginal"):
        rows = report[name]["bins"]
        ax.plot([r["confidence"] for r in rows], [r["acceptance"] for r in rows], marker="o",
                label=f"{name} (ECE {report[name]['ece']:.3f})")
    ax.set_xlabel("confidence of the drafted token")
    ax.set_ylabel("acceptance rate (given the prefix was accepted)")
    ax.set_title(f"DFlash2 calibration, T = {report['temperature']:g}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="a DFlash2 drafter checkpoint")
    ap.add_argument("--prompts", required=True, help="held-out prompts (JSONL / datasets source, as flashdraft train)")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from flashdraft import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair
    from flashdraft.model import DFlash2DraftModel
    from flashdraft.train.data import load_prompts

    target, tokenizer, drafter = load_pair(args.target, args.draft, device="cpu")
    if not isinstance(drafter, DFlash2DraftModel):
        print(f"calibration: error: {args.draft} is not a DFlash2 drafter", file=sys.stderr)
        return 2
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    with SpecEngine(target, drafter, tokenizer, draft_policy="fixed") as engine:
        engine.proposer.confidence = True
        selector, marginal, accepted, taus = collect(engine, prompts, params)
    report = {"target": args.target, "draft": args.draft, "prompts": len(prompts), "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "tau": sum(taus) / len(taus),
              "selector": reliability(selector, accepted), "marginal": reliability(marginal, accepted)}
    print(f"{len(prompts)} prompts, T = {args.temperature:g}, tau {report['tau']:.2f}, {len(accepted)} scored drafts "
          f"(acceptance rate {report['selector']['acceptance_rate']:.3f})")
    for name in ("selector", "marginal"):
        r = report[name]
        print(f"  {name:9s} ECE {r['ece']:.4f}  Brier {r['brier']:.4f}  mean confidence {r['mean_confidence']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
