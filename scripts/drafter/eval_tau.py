"""Tau of a drafter as a distribution over prompts, in-domain and out-of-domain, by prompt ending and length.

    python scripts/drafter/eval_tau.py [--draft DIR] [--target DIR] [--num 32] [--lengths prompt,256,1024,1800]
                                       [--temperature 0] [--sampler gumbel|rejection]
                                       [--lookup-splice N] [--threads 1] [--out runs/eval_tau/NAME]
                                       [--draft-vocab-size N --vocab-data data/default_pair/regen_mix]
    python scripts/drafter/eval_tau.py --compare BEFORE/results.json AFTER/results.json

Sets (each cut deterministically, seed 0):
- `in-domain`: the default pair's held-out corpus split (stdlib files the target and the drafter never trained on).
  Length `prompt`: the shipped held-out prompts (starts of functions, ending mid-line), and the same prompts
  followed by a newline.
- `ood`: Python sources of installed third-party packages (transformers, torch): code neither model saw. Length
  `prompt`: the `ood-code` / `ood-code-nl` bench prompts (about 320 characters).
Lengths 256 / 1024 / 1800: contexts of that many tokens starting at a line start of a random file, ending mid-line
(`mid-line`) or right after a newline (`newline`); the target's window is 2048, so 1800 + 128 new tokens fit.

Every prompt runs alone (batch 1), block 16, the fixed draft policy (every cycle verifies the whole block), the
engine's prompt-lookup splice (`--lookup-splice`, default the engine's; 0 measures the drafter's chain alone), greedy
or at `--temperature` with seed = the prompt's index in its cell (so two drafters see the same noise), up to
`--max-new-tokens` (stopping at eos); tau of a prompt = its mean acceptance length over cycles. Per (set, ending,
length) cell: min / p10 / median / mean over prompts, and the pooled tau (all cycles of the cell). Only tau is measured, not time, so a busy machine does not change the figures.
Writes `results.json`, `results.md` and `tau.png` (box plots per cell) into `--out`.

`--draft-vocab-size N` restricts an existing full-vocabulary drafter to the N most frequent response tokens of the
regenerated training data `--vocab-data` (as `flashdraft train --draft-vocab-size` chooses them): its read-out
becomes those rows of the target's lm_head.

What this script does not know about: training, and timings (`vocab_curve.py` measures draft time).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.default_pair.coverage import cut_context  # noqa: E402

ENDINGS = ("mid-line", "newline")
SETS = ("in-domain", "ood")


def cut_contexts(documents: list[str], tokenizer, num: int, tokens: int, ending: str, seed: int = 0) -> list[list[int]]:
    """`num` contexts of about `tokens` tokens, each from a random line start of a random document."""
    rng, out, tries = random.Random(f"{seed}:{tokens}:{ending}"), [], 0
    docs = [d for d in documents if d.count("\n") >= 20]
    while len(out) < num:
        tries += 1
        if tries > 200 * num:
            raise RuntimeError(f"could not cut {num} contexts of {tokens} tokens ending {ending}")
        lines = rng.choice(docs).splitlines(keepends=True)
        start = rng.randrange(len(lines) - 10)
        text = cut_context("".join(lines[start:start + tokens // 2 + 40]), tokenizer, tokens, ending)
        if text is not None:
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def heldout_documents() -> list[str]:
    from scripts.default_pair.corpus import load_corpus

    return [d["text"] for d in load_corpus("heldout")]


def package_documents(packages=("transformers", "torch")) -> list[str]:
    from flashdraft.bench.datasets import _source_files

    return [p.read_text(errors="replace") for p in _source_files(packages)]


def short_prompts(name: str, ending: str, num: int) -> list[str]:
    """Natural short prompts: the shipped held-out prompts (in-domain) or the bench's ood-code prompts."""
    if name == "in-domain":
        from flashdraft.demo import load_heldout_prompts

        prompts = load_heldout_prompts(num)
        return prompts if ending == "mid-line" else [p + "\n" for p in prompts]
    from flashdraft.bench.datasets import source_prompts

    return source_prompts(num, end_at_line_start=ending == "newline")


def build_cells(tokenizer, num: int, lengths: list[str]) -> dict[tuple[str, str, str], list[list[int]]]:
    """{(set, ending, length): [prompt ids]} for every cell."""
    docs = {"in-domain": heldout_documents(), "ood": package_documents()}
    cells = {}
    for name in SETS:
        for ending in ENDINGS:
            for length in lengths:
                if length == "prompt":
                    cells[(name, ending, length)] = [tokenizer(p, add_special_tokens=False)["input_ids"]
                                                     for p in short_prompts(name, ending, num)]
                else:
                    cells[(name, ending, length)] = cut_contexts(docs[name], tokenizer, num, int(length), ending)
    return cells


def percentile(values: list[float], q: float) -> float:
    from flashdraft.bench.metrics import percentile as pct

    return pct(values, q)


FIRST_CYCLES = 4  # drafting cycles of an answer whose mean acceptance `by_cycle` reports


def distribution(taus: list[float], lengths: list[int]) -> dict:
    return {"prompts": len(taus), "min": min(taus), "p10": percentile(taus, 0.1), "median": statistics.median(taus),
            "mean": statistics.fmean(taus), "pooled": sum(lengths) / len(lengths)}


def by_cycle(per_prompt: list[list[int]], cycles: int = FIRST_CYCLES) -> list[float]:
    """Mean acceptance length of an answer's 1st, 2nd .. drafting cycle over the prompts that reached it: an
    answer's first drafts accept far less than its later ones, which a short answer (a server's 64 tokens) feels."""
    return [round(statistics.fmean(lengths[i] for lengths in per_prompt if len(lengths) > i), 3)
            for i in range(cycles) if any(len(lengths) > i for lengths in per_prompt)]


def measure(engine, cells: dict, max_new_tokens: int, eos: int | None, progress: bool = True,
            temperature: float = 0.0) -> dict:
    from tqdm import tqdm

    from flashdraft.engine import SamplingParams

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                              stop_token_ids=(eos,) if eos is not None else ())

    results = {}
    bar = tqdm(total=sum(len(v) for v in cells.values()), desc="eval tau", unit="prompt", disable=not progress,
               dynamic_ncols=True)
    for key, prompts in cells.items():
        taus, all_lengths, context, per_prompt = [], [], [], []
        for index, ids in enumerate(prompts):
            out = engine.generate([ids], params(index))[0]
            bar.update(1)
            if out.stats.acceptance_lengths:  # an immediate eos drafts nothing
                taus.append(out.stats.tau)
                all_lengths += out.stats.acceptance_lengths
                per_prompt.append(out.stats.acceptance_lengths)
                context.append(len(ids))
        results["|".join(key)] = {**distribution(taus, all_lengths), "mean_context_tokens": statistics.fmean(context),
                                  "by_cycle": by_cycle(per_prompt),
                                  "per_prompt_tau": [round(t, 4) for t in taus]}
        bar.set_postfix_str(f"{'/'.join(key)} mean {results['|'.join(key)]['mean']:.2f}")
    bar.close()
    return results


def response_counts(data: Path, tokenizer, vocab_size: int):
    """Token counts of the responses in regenerated training data (what `flashdraft train --draft-vocab-size`
    chooses its vocabulary from)."""
    from flashdraft.model.draft_vocab import response_token_counts
    from flashdraft.train.data import load_examples

    return response_token_counts(load_examples(data, tokenizer, eos_token_id=tokenizer.eos_token_id), vocab_size)


def restrict_vocab(drafter, target, counts, size: int):
    """A copy of a full-vocabulary drafter whose read-out covers the `size` most frequent tokens of `counts` only
    (its own lm_head = those rows of the target's lm_head, `d2t` = their offsets)."""
    from flashdraft.model.draft_vocab import restrict_drafter, select_draft_vocab

    return restrict_drafter(drafter, target.get_output_embeddings().weight, select_draft_vocab(counts, size))


def cell_table(title: str, lengths: list[str], cell) -> str:
    """Markdown: one row per (set, ending), one column per length, `cell(key)` -> text ("-" when it is None)."""
    lines = [title, "", "| set | ending | " + " | ".join(lengths) + " |", "|---|---|" + "---|" * len(lengths)]
    for name in SETS:
        for ending in ENDINGS:
            row = [cell(f"{name}|{ending}|{length}") or "-" for length in lengths]
            lines.append(f"| {name} | {ending} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def markdown(results: dict, lengths: list[str], label: str) -> str:
    def cell(key):
        r = results.get(key)
        return r and f"{r['min']:.2f} / {r['p10']:.2f} / {r['median']:.2f} / **{r['mean']:.2f}** ({r['pooled']:.2f})"

    def first(key):
        r = results.get(key)
        return r and r.get("by_cycle") and " / ".join(f"{x:.2f}" for x in r["by_cycle"])

    return (cell_table(f"tau per prompt, {label}: min / p10 / median / mean (pooled)", lengths, cell) + "\n"
            + cell_table(f"mean acceptance length of an answer's drafting cycles 1 / 2 / .. / {FIRST_CYCLES}, {label}",
                         lengths, first))


def comparison(before: dict, after: dict) -> str:
    """Markdown: mean and p10 per cell, `before` -> `after` (two results.json of this script)."""
    def cell(key):
        a, b = before["cells"].get(key), after["cells"].get(key)
        return a and b and f"{a['mean']:.2f} ({a['p10']:.2f}) -> **{b['mean']:.2f}** ({b['p10']:.2f})"

    return cell_table(f"tau per prompt, mean (p10): {before['label']} -> {after['label']}",
                      [x for x in before["lengths"] if x in after["lengths"]], cell)


def plot(results: dict, lengths: list[str], label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, name in zip(axes, SETS):
        data, ticks, colors = [], [], []
        for length in lengths:
            for ending, color in zip(ENDINGS, ("tab:blue", "tab:orange")):
                r = results.get(f"{name}|{ending}|{length}")
                data.append(r["per_prompt_tau"] if r else [])
                ticks.append(f"{length}\n{ending}")
                colors.append(color)
        box = ax.boxplot(data, whis=(10, 90), showmeans=True, patch_artist=True)
        for patch, color in zip(box["boxes"], colors):
            patch.set_facecolor(color)
            patch.set_alpha(0.5)
        ax.set_xticks(range(1, len(ticks) + 1), ticks, fontsize=8)
        ax.set_title(f"{name}")
        ax.set_xlabel("context length (tokens) / prompt ending")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("tau per prompt (whiskers p10-p90, triangle = mean)")
    fig.suptitle(f"tau distribution over prompts: {label}")
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pair_arguments(ap: argparse.ArgumentParser) -> None:
    """--target / --draft (default: the shipped pair) and --threads, as both drafter scripts take them."""
    ap.add_argument("--target", default=None, help="target directory (default: the shipped pair's)")
    ap.add_argument("--draft", default=None, help="drafter directory (default: the shipped pair's)")
    ap.add_argument("--threads", type=int, default=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_arguments(ap)
    ap.add_argument("--num", type=int, default=32, help="prompts per cell")
    ap.add_argument("--lengths", default="prompt,256,1024,1800")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--sampler", choices=("gumbel", "rejection"), default="gumbel",
                    help="how sampled drafts are verified (the engine's --sampler)")
    ap.add_argument("--dflash2-race", choices=("marginal", "selector"), default=None,
                    help="what a DFlash2 drafter's sampled rows race on under the gumbel sampler (default: the "
                         "proposer's: the selector where every token is a candidate, else the marginal; "
                         "dflash2_proposer.py)")
    ap.add_argument("--walk-candidates", type=int, default=None, metavar="K",
                    help="a DFlash2 selector over every token walks among each position's K likeliest winners "
                         "(the engine's --walk-candidates; default 16, 0 = every token)")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="restrict a full-vocabulary drafter to this many most frequent tokens (needs --vocab-data)")
    ap.add_argument("--vocab-data", type=Path, default=None, help="regenerated training data to count tokens in")
    ap.add_argument("--lookup-splice", type=int, default=None, choices=range(0, 9), metavar="N",
                    help="the engine's prompt-lookup splice of chains (`lookup.py`; default: the engine's, 4; 0 = "
                         "the drafter's chain alone)")
    ap.add_argument("--label", default=None, help="name of the drafter in the table and plot")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "eval_tau" / "default")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                    help="print the mean (p10) per cell of two results.json files instead of evaluating")
    args = ap.parse_args(argv)
    if args.compare:
        print(comparison(*(json.loads(p.read_text()) for p in args.compare)), end="")
        return 0
    lengths = [x.strip() for x in args.lengths.split(",") if x.strip()]
    bad = [x for x in lengths if x != "prompt" and not (x.isdigit() and 16 <= int(x) <= 1900)]
    if bad:
        ap.error(f"--lengths: {bad} (use 'prompt' or token counts from 16 to 1900)")
    if not 0.0 <= args.temperature <= 100.0:
        ap.error(f"--temperature {args.temperature}: use a value in [0, 100]")
    if args.draft_vocab_size and not args.vocab_data:
        ap.error("--draft-vocab-size needs --vocab-data")

    import torch

    from flashdraft.engine import EngineConfig, SpecEngine
    from flashdraft.loading import load_pair

    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(args.target, args.draft, "cpu" if not torch.cuda.is_available() else None)
    if args.draft_vocab_size:
        counts = response_counts(args.vocab_data, tokenizer, target.config.vocab_size)
        drafter = restrict_vocab(drafter, target, counts, args.draft_vocab_size)
    label = args.label or (args.draft or "shipped drafter") + (f", draft vocab {args.draft_vocab_size}"
                                                              if args.draft_vocab_size else "")
    label += f", T = {args.temperature:g} ({args.sampler})" if args.temperature > 0 else ", greedy"
    cells = build_cells(tokenizer, args.num, lengths)
    if args.lookup_splice is None:
        args.lookup_splice = EngineConfig.lookup_splice
    engine = SpecEngine(target, drafter, tokenizer, EngineConfig(block_size=args.block_size, draft_policy="fixed",
                                                                 sampler=args.sampler,
                                                                 lookup_splice=args.lookup_splice))
    if args.lookup_splice:
        label += f", lookup splice {args.lookup_splice}"
    if args.dflash2_race:
        if not hasattr(engine.proposer, "sampled_race"):
            ap.error("--dflash2-race needs a DFlash2 drafter")
        engine.proposer.sampled_race = args.dflash2_race
        label += f", {args.dflash2_race} race"
    if args.walk_candidates is not None:
        if not hasattr(engine.proposer, "walk_candidates") or args.walk_candidates < 0:
            ap.error("--walk-candidates needs a DFlash2 drafter and K >= 0")
        engine.proposer.walk_candidates = args.walk_candidates
        label += f", walk among {args.walk_candidates or 'every token'}"
    t0 = time.perf_counter()
    results = measure(engine, cells, args.max_new_tokens, tokenizer.eos_token_id, temperature=args.temperature)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(results, lengths, label)
    (args.out / "results.json").write_text(json.dumps(
        {"label": label, "draft": args.draft, "target": args.target, "num": args.num, "lengths": lengths,
         "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
         "temperature": args.temperature, "sampler": args.sampler, "dflash2_race": args.dflash2_race,
         "walk_candidates": args.walk_candidates,
         "draft_vocab_size": args.draft_vocab_size, "lookup_splice": args.lookup_splice,
         "wall_s": round(time.perf_counter() - t0, 1),
         "cells": results}, indent=1))
    (args.out / "results.md").write_text(table)
    plot(results, lengths, label, args.out / "tau.png")
    print(table)
    print(f"wrote {args.out}/results.json, results.md, tau.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
