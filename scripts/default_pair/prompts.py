"""Prompt files for the default pair: held-out prompts shipped with the package (the demo, bench and server use
them) and train prompts whose responses the target regenerates for drafter training.

    python scripts/default_pair/prompts.py [--train N] [--heldout N] [--coverage N] [--foreign N]

`--train`: starts of functions/classes of the train split (`train_prompts.jsonl`). `--coverage`: contexts of 16 to
1900 tokens from the train split ending at line starts, mid-line, mid-token, after blank lines and in comments,
some as chat (`coverage.py`), written to `coverage_prompts.jsonl`, and both sets together to `mix_prompts.jsonl`.
`--foreign`: the same kinds of contexts cut from installed third-party packages' sources (`coverage.package_documents`:
code the target never saw, disjoint from the out-of-domain evaluation's), written to `foreign_prompts.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from corpus import heldout_prompts, load_corpus, train_prompts  # noqa: E402

HELDOUT_OUT = ROOT / "flashdraft" / "assets" / "default_pair" / "heldout_prompts.jsonl"
TRAIN_OUT = ROOT / "data" / "default_pair" / "train_prompts.jsonl"
COVERAGE_OUT = ROOT / "data" / "default_pair" / "coverage_prompts.jsonl"
MIX_OUT = ROOT / "data" / "default_pair" / "mix_prompts.jsonl"
FOREIGN_OUT = ROOT / "data" / "default_pair" / "foreign_prompts.jsonl"


def write(path: Path, prompts: list) -> None:
    """One JSON object per line: strings become {"prompt": ...}, records are written as they are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p} if isinstance(p, str) else p) + "\n" for p in prompts))
    print(f"{path}: {len(prompts)} prompts")


def target_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "flashdraft" / "assets" / "default_pair" / "target")


def write_coverage(num: int, train: list[str]) -> None:
    from coverage import coverage_prompts

    records = coverage_prompts([d["text"] for d in load_corpus("train")], target_tokenizer(), num)
    write(COVERAGE_OUT, records)
    write(MIX_OUT, train + records)


def write_foreign(num: int) -> None:
    from coverage import coverage_prompts, package_documents

    write(FOREIGN_OUT, coverage_prompts(package_documents(), target_tokenizer(), num, seed=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--coverage", type=int, default=0, help="coverage prompts (0 = none)")
    ap.add_argument("--foreign", type=int, default=0, help="coverage prompts from third-party code (0 = none)")
    args = ap.parse_args(argv)
    write(HELDOUT_OUT, heldout_prompts(args.heldout))
    train = train_prompts(args.train)
    write(TRAIN_OUT, train)
    if args.coverage:
        write_coverage(args.coverage, train)
    if args.foreign:
        write_foreign(args.foreign)


if __name__ == "__main__":
    main()
