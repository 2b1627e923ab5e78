"""Tau against the token tree's node budget, as a distribution over prompts, in-domain and out-of-domain.

    python scripts/tree/tau_curve.py [--draft DIR] [--target DIR] [--num 32] [--max-new-tokens 128]
                                     [--budgets 0,8,16,32,64,128] [--t1-budgets 0,16,64] [--batch 32]
                                     [--threads 1] [--label NAME] [--out runs/tree/NAME]

Cells: the short-prompt sets of `scripts/drafter/eval_tau.py` (imported, not rebuilt): `in-domain` = the shipped
held-out prompts, `ood` = the `ood-code` bench prompts from installed packages' sources, each ending mid-line and
right after a newline. Per budget (0 = the argmax chain: the bonus + block - 1 drafts; N = a best-first tree of N
nodes besides the root, `EngineConfig.tree_budget`) every prompt of a cell generates `--max-new-tokens` (stopping at
eos) under the fixed draft policy, so every cycle drafts and tau is the drafter's and the tree's, not the policy's.
Tau of a prompt = its mean acceptance length (accepted path depth + 1) over cycles; per cell: min / p10 / median /
mean over prompts, the pooled tau, and the nodes verified per cycle. Greedy at every budget in `--budgets`;
temperature 1 (the engine's Gumbel sampler, seed = the prompt's index, so every budget sees the same noise and
the same output) at the budgets in `--t1-budgets`. Prompts of a cell run as one batch (`--batch`), which changes
no token (greedy and Gumbel output are batch-invariant in what they commit) but is several times faster.

Writes `results.json` (after each budget: a stopped run keeps what it measured), `results.md` and `tau.png` (tau
mean and p10 against the budget, one line per cell) into `--out`. Only tau is measured: a busy machine does not
change the figures. `scripts/tree/verify_cost.py` turns this curve into projected tokens/s.

What this script does not know about: time (see verify_cost.py), the adaptive policy's `tree_budget="auto"`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.drafter.eval_tau import (ENDINGS, SETS, distribution, pair_arguments, save_figure,  # noqa: E402
                                      short_prompts)

CHAIN = 0
GAIN_TARGET = (1.12, 64)  # issue 23: tau >= 1.12x the chain's with at most 64 nodes


def parse_budgets(text: str, option: str) -> list[int]:
    try:
        budgets = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{option}: {text!r} is not a comma-separated list of integers") from None
    if not budgets or any(not 0 <= b <= 512 for b in budgets):
        raise SystemExit(f"{option}: {text!r}: use node budgets in [0, 512] (0 = the chain)")
    return sorted(set(budgets))


def budget_name(budget: int) -> str:
    return "chain" if budget == CHAIN else str(budget)


def build_cells(tokenizer, num: int) -> dict[str, list[list[int]]]:
    """{"set|ending": [prompt ids]}: eval_tau.py's short prompts of every set and ending."""
    return {f"{name}|{ending}": [tokenizer(p, add_special_tokens=False)["input_ids"]
                                 for p in short_prompts(name, ending, num)]
            for name in SETS for ending in ENDINGS}


def measure_cell(engine, prompts: list[list[int]], max_new_tokens: int, eos: int | None, temperature: float,
                 batch: int) -> dict:
    """The cell's prompts through `engine` in batches: tau distribution over prompts and nodes verified per cycle."""
    from flashdraft.engine import SamplingParams

    taus, lengths, widths = [], [], []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=start + i,
                                 stop_token_ids=(eos,) if eos is not None else ()) for i in range(len(chunk))]
        for out in engine.generate(chunk, params):
            if out.stats.acceptance_lengths:  # an immediate eos drafts nothing
                taus.append(out.stats.tau)
                lengths += out.stats.acceptance_lengths
                widths += out.stats.verify_widths
    return {**distribution(taus, lengths), "nodes_per_cycle": statistics.fmean(widths),
            "per_prompt_tau": [round(t, 4) for t in taus]}


def measure_curve(target, drafter, tokenizer, cells: dict, budgets: list[int], temperature: float, args,
                  on_budget=None) -> dict:
    """{budget name: {cell: figures}} at one temperature; `on_budget(curve)` after each budget (to save)."""
    from flashdraft.engine import EngineConfig, SpecEngine

    curve = {}
    for budget in budgets:
        engine = SpecEngine(target, drafter, tokenizer, EngineConfig(block_size=args.block_size, draft_policy="fixed",
                                                                     tree_budget=budget))
        try:
            curve[budget_name(budget)] = row = {}
            for key, prompts in cells.items():
                t0 = time.perf_counter()
                row[key] = measure_cell(engine, prompts, args.max_new_tokens, tokenizer.eos_token_id, temperature,
                                        args.batch)
                row[key]["wall_s"] = round(time.perf_counter() - t0, 1)
                print(f"  T={temperature:g} {budget_name(budget):>5} {key:18s} tau mean {row[key]['mean']:.2f} "
                      f"p10 {row[key]['p10']:.2f} nodes/cycle {row[key]['nodes_per_cycle']:.1f} "
                      f"({row[key]['wall_s']:.0f} s)", flush=True)
        finally:
            engine.close()
        if on_budget:
            on_budget(curve)
    return curve


def gains(curve: dict) -> dict:
    """Per cell: mean tau of each tree budget / the chain's (when the chain was measured)."""
    chain = curve.get("chain")
    if not chain:
        return {}
    return {key: {name: round(row[key]["mean"] / chain[key]["mean"], 4) for name, row in curve.items()}
            for key in chain}


def markdown(curves: dict, label: str) -> str:
    out = []
    for temp, curve in curves.items():
        names = list(curve)
        if not names:
            continue
        ratio = gains(curve)
        head = "| set | ending | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names)
        rows = []
        for key in curve[names[0]]:
            cells = []
            for name in names:
                r = curve[name][key]
                gain = f" {ratio[key][name]:.2f}x" if ratio and name != "chain" else ""
                cells.append(f"**{r['mean']:.2f}** ({r['p10']:.2f}){gain}")
            rows.append("| " + " | ".join(key.split("|")) + " | " + " | ".join(cells) + " |")
        out.append(f"tau per prompt, {label}, {temp}: **mean** (p10) and mean / chain's, by node budget\n\n"
                   + head + "\n" + "\n".join(rows) + "\n")
        detail = ["| set | ending | budget | min | p10 | median | mean | pooled | nodes / cycle |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key in curve[names[0]]:
            for name in names:
                r = curve[name][key]
                detail.append(f"| {' | '.join(key.split('|'))} | {name} | {r['min']:.2f} | {r['p10']:.2f} | "
                              f"{r['median']:.2f} | {r['mean']:.2f} | {r['pooled']:.2f} | {r['nodes_per_cycle']:.1f} |")
        out.append(f"{temp}, full distribution over prompts\n\n" + "\n".join(detail) + "\n")
    return "\n".join(out)


def target_check(curve: dict) -> dict:
    """Issue 23's target per cell: the smallest budget <= 64 nodes whose mean tau >= 1.12x the chain's (None:
    none does)."""
    ratio, (factor, most) = gains(curve), GAIN_TARGET
    return {key: next((name for name, g in per.items() if name != "chain" and int(name) <= most and g >= factor),
                      None) for key, per in ratio.items()}


def plot(curves: dict, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = [t for t, c in curves.items() if c]
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.5), squeeze=False)
    colors = dict(zip([f"{s}|{e}" for s in SETS for e in ENDINGS], ("tab:blue", "tab:cyan", "tab:red", "tab:orange")))
    for ax, temp in zip(axes[0], temps):
        curve = curves[temp]
        names = list(curve)
        x = range(len(names))
        for key, color in colors.items():
            if key not in curve[names[0]]:
                continue
            ax.plot(x, [curve[n][key]["mean"] for n in names], "o-", color=color, label=f"{key} mean")
            ax.plot(x, [curve[n][key]["p10"] for n in names], "s--", color=color, alpha=0.6, label=f"{key} p10")
        ax.set_xticks(list(x), ["chain\n(15)" if n == "chain" else n for n in names])
        ax.set_xlabel("tree nodes besides the root (chain: 15 drafts)")
        ax.set_ylabel("tau (accepted path depth + 1)")
        ax.set_title(temp)
        ax.grid(alpha=0.3)
    # the last panel's lower right is empty (T = 1 curves rise steeply); greedy alone: its upper right
    axes[0][-1].legend(fontsize=7, ncol=2, loc="lower right" if len(temps) > 1 else "upper right")
    fig.suptitle(f"tau against the node budget: {label}")
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_arguments(ap)
    ap.add_argument("--num", type=int, default=32, help="prompts per cell")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", default="0,8,16,32,64,128", help="greedy node budgets (0 = the chain)")
    ap.add_argument("--t1-budgets", default="0,16,64", help="temperature-1 node budgets ('' = none)")
    ap.add_argument("--batch", type=int, default=32, help="prompts per engine.generate call")
    ap.add_argument("--label", default=None, help="name of the drafter in the tables and plot")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "tree" / "shipped")
    args = ap.parse_args(argv)
    budgets = parse_budgets(args.budgets, "--budgets")
    t1_budgets = parse_budgets(args.t1_budgets, "--t1-budgets") if args.t1_budgets.strip() else []
    if args.num < 1 or args.batch < 1 or args.max_new_tokens < 1:
        ap.error("--num, --batch and --max-new-tokens must be >= 1")

    import torch

    from flashdraft.loading import load_pair

    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(args.target, args.draft, "cpu" if not torch.cuda.is_available() else None)
    if drafter is None:
        raise SystemExit("no drafter: pass --draft DIR with --target")
    label = args.label or args.draft or "shipped drafter"
    cells = build_cells(tokenizer, args.num)
    args.out.mkdir(parents=True, exist_ok=True)
    curves = {"greedy": {}, "T = 1 (gumbel)": {}}
    started = time.perf_counter()

    def save(_=None):
        (args.out / "results.json").write_text(json.dumps(
            {"label": label, "draft": args.draft, "target": args.target, "num": args.num,
             "max_new_tokens": args.max_new_tokens, "block_size": args.block_size, "budgets": budgets,
             "t1_budgets": t1_budgets, "batch": args.batch, "wall_s": round(time.perf_counter() - started, 1),
             "loadavg": os.getloadavg(), "curves": curves,
             "gain_over_chain": {t: gains(c) for t, c in curves.items()},
             "issue23_target_budget": {t: target_check(c) for t, c in curves.items()}}, indent=1))

    curves["greedy"] = measure_curve(target, drafter, tokenizer, cells, budgets, 0.0, args,
                                     lambda c: (curves.__setitem__("greedy", c), save()))
    if t1_budgets:
        curves["T = 1 (gumbel)"] = measure_curve(target, drafter, tokenizer, cells, t1_budgets, 1.0, args,
                                                 lambda c: (curves.__setitem__("T = 1 (gumbel)", c), save()))
    save()
    table = markdown(curves, label)
    (args.out / "results.md").write_text(table)
    plot(curves, label, args.out / "tau.png")
    print(table)
    for temp, check in ((t, target_check(c)) for t, c in curves.items() if c):
        print(f"{temp}: smallest budget <= {GAIN_TARGET[1]} nodes with tau >= {GAIN_TARGET[0]}x the chain's: {check}")
    print(f"wrote {args.out}/results.json, results.md, tau.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
