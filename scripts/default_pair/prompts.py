"""Prompt files for the default pair: held-out prompts shipped with the package (the demo, bench and server use
them) and train prompts whose responses the target regenerates for drafter training.

    python scripts/default_pair/prompts.py [--train N] [--heldout N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from corpus import heldout_prompts, train_prompts  # noqa: E402

HELDOUT_OUT = ROOT / "flashdraft" / "assets" / "default_pair" / "heldout_prompts.jsonl"
TRAIN_OUT = ROOT / "data" / "default_pair" / "train_prompts.jsonl"


def write(path: Path, prompts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{path}: {len(prompts)} prompts")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--heldout", type=int, default=64)
    args = ap.parse_args(argv)
    write(HELDOUT_OUT, heldout_prompts(args.heldout))
    write(TRAIN_OUT, train_prompts(args.train))


if __name__ == "__main__":
    main()
