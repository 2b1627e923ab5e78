"""How well a drafter's confidence in its drafts predicts their acceptance, and what trimming verifies by it buys.

    python scripts/drafter/confidence_trim.py [--draft DIR] [--target DIR] [--num 32] [--temperature 0]
        [--max-new-tokens 128] [--threads 1] [--out runs/confidence_trim]

Every prompt of eval_tau's short cells (in-domain and out-of-domain, ending mid-line and in a newline) runs alone
(batch 1) with the fixed policy and no prompt lookup, so every cycle verifies the drafter's whole block; the
drafter reports its confidence in each draft as the engine's confidence trim reads it (`drafted_confidence`:
greedy rows p1 / (p1 + p2) of its logits, sampled rows q of the draft at the row's temperature). The event scored
is the one the trim prices: draft i accepted GIVEN that drafts 1 .. i-1 were.

Reported per set: the expected calibration error (ECE, 10 equal bins) of the raw confidence and of the engine's
`ConfidenceCalibration` fitted on the OTHER set's drafts (held-out calibration: in-domain fitted on ood and the
reverse), and the trim's frontier: for a price per verified draft (in expected accepted drafts; the engine derives
it from its cost curve and the batch's rate), the share of drafts the trim verifies and the share of the full
block's accepted drafts it keeps (`policy.trimmed_width` over the calibrated survivals, widths 1, 2, 4, 8, 16).
Writes results.json, results.md and confidence.png (reliability diagram, frontier) into --out.

What this script does not know about: time (the engine prices a verified draft from its measured costs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.dflash2.calibration import reliability  # noqa: E402
from scripts.drafter.eval_tau import ENDINGS, SETS, short_prompts  # noqa: E402

PRICES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def collect(engine, prompts, params) -> list[tuple[np.ndarray, int]]:
    """(the drafter's confidence in each draft [k], drafts accepted) of every drafting cycle."""
    proposer, seen = engine.proposer, []
    original = proposer.propose

    def recording(state, inp, block_size):
        out = original(state, inp, block_size)
        seen.append(proposer.drafted_confidence()[0].float().cpu().numpy())
        return out

    proposer.propose = recording
    cycles = []
    try:
        for prompt in prompts:
            seen.clear()
            stats = engine.generate([prompt], params)[0].stats
            cycles += [(conf, length - 1) for conf, length in zip(seen, stats.acceptance_lengths)]
    finally:
        proposer.propose = original
    return cycles


def events(cycles) -> tuple[np.ndarray, np.ndarray]:
    """(confidence, accepted) of every draft verified with all drafts before it accepted."""
    conf, ok = [], []
    for c, accepted in cycles:
        scored = min(accepted + 1, len(c))
        conf.append(c[:scored])
        ok.append(np.arange(scored) < accepted)
    return np.concatenate(conf), np.concatenate(ok)


def fitted(cycles, sampled: bool):
    """The engine's calibration, fed these cycles' events."""
    from flashdraft.engine.policy import ConfidenceCalibration

    calibration = ConfidenceCalibration()
    conf, ok = events(cycles)
    calibration.update(sampled, conf, ok.astype(np.float64))
    return calibration


def frontier(cycles, calibration, sampled: bool, block_size: int) -> list[dict]:
    """Per price: the share of drafts the trim verifies and the share of accepted drafts it keeps."""
    from flashdraft.engine.policy import trimmed_width, width_choices

    choices = list(width_choices(block_size)[1:])
    full_verified = sum(len(c) for c, _ in cycles)
    full_accepted = sum(a for _, a in cycles)
    rows = []
    for price in PRICES:
        verified = accepted = 0
        for c, a in cycles:
            width = trimmed_width(np.cumprod(calibration(sampled, c)), choices, price)
            verified += width - 1
            accepted += min(a, width - 1)
        rows.append({"price": price, "verified_share": verified / full_verified,
                     "accepted_share": accepted / max(full_accepted, 1)})
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    left.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for name, r in report["sets"].items():
        for kind, style in (("raw", "-"), ("calibrated", ":")):
            bins = r[kind]["bins"]
            left.plot([b["confidence"] for b in bins], [b["acceptance"] for b in bins], marker="o", ls=style,
                      label=f"{name}, {kind} (ECE {r[kind]['ece']:.3f})")
        right.plot([x["verified_share"] for x in r["frontier"]], [x["accepted_share"] for x in r["frontier"]],
                   marker="o", label=name)
        for x in r["frontier"]:
            right.annotate(f"{x['price']:g}", (x["verified_share"], x["accepted_share"]), fontsize=7)
    left.set_xlabel("confidence (calibrated: the engine's estimate)")
    left.set_ylabel("acceptance given the drafts before were accepted")
    left.set_title(f"calibration, T = {report['temperature']:g}", fontsize=10)
    left.legend(fontsize=7)
    right.set_xlabel("share of the block's drafts verified")
    right.set_ylabel("share of accepted drafts kept")
    right.set_title("confidence trim by price per verified draft", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def markdown(report: dict) -> str:
    lines = [f"Confidence of `{report['draft']}`, T = {report['temperature']:g}, {report['prompts_per_set']} prompts "
             f"per set, batch 1, whole blocks\n",
             "| set | drafts scored | acceptance | ECE raw | ECE calibrated (fitted on the other set) |",
             "|---|---|---|---|---|"]
    for name, r in report["sets"].items():
        lines.append(f"| {name} | {r['raw']['events']} | {r['raw']['acceptance_rate']:.3f} | {r['raw']['ece']:.3f} "
                     f"| {r['calibrated']['ece']:.3f} |")
    lines += ["", "Trim frontier: verified share / accepted share by price per verified draft", "",
              "| set | " + " | ".join(f"{p:g}" for p in PRICES) + " |", "|---|" + "---|" * len(PRICES)]
    for name, r in report["sets"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x['verified_share']:.2f} / {x['accepted_share']:.3f}"
                                                 for x in r["frontier"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--num", type=int, default=32, help="prompts per (set, ending)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/confidence_trim")
    args = ap.parse_args(argv)
    if args.num < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        ap.error("--num and --max-new-tokens must be >= 1 and --temperature >= 0")
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from flashdraft import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair

    target, tokenizer, drafter = load_pair(args.target, args.draft, device="cpu")
    if drafter is None:
        ap.error("a drafter is needed (--draft)")
    sampled = args.temperature > 0
    cycles = {}
    with SpecEngine(target, drafter, tokenizer, draft_policy="fixed", lookup_splice=0, lookup_steps=0) as engine:
        engine.proposer.confidence = True
        for name in tqdm(SETS, desc="sets"):
            prompts = [tokenizer(p, add_special_tokens=False)["input_ids"]
                       for ending in ENDINGS for p in short_prompts(name, ending, args.num)]
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0,
                                    stop_token_ids=(tokenizer.eos_token_id,))
            cycles[name] = collect(engine, prompts, params)
        block_size = engine.block_size
    report = {"draft": args.draft or "shipped", "temperature": args.temperature, "prompts_per_set": 2 * args.num,
              "sets": {}}
    for name in SETS:
        other = fitted([c for n in SETS if n != name for c in cycles[n]], sampled)
        conf, ok = events(cycles[name])
        report["sets"][name] = {
            "cycles": len(cycles[name]),
            "raw": reliability(torch.from_numpy(conf), torch.from_numpy(ok)),
            "calibrated": reliability(torch.from_numpy(other(sampled, conf)), torch.from_numpy(ok)),
            "frontier": frontier(cycles[name], other, sampled, block_size)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "results.md").write_text(markdown(report))
    plot(report, out / "confidence.png")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
