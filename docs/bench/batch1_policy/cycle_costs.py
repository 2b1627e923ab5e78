"""What a cycle costs at batch 1 by verify width: the shipped pair as `flashdraft demo --threads 1` builds it, each
held-out prompt's row stepping through forced widths 1, 2, 4, 8, 16 and back, six times (`SpecEngine._cycle` with
`forced_width`, as `warmup` times them); median ms of the whole cycle and of its body (the cycle less the draft and
the context write: what the draft policy's `CostModel.body` curve holds).

    python docs/bench/batch1_policy/cycle_costs.py [--num 8]

What this script does not know about: more than one row (`scripts/memory/step_cost.py`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from flashdraft.args import apply_threads, engine_from_args, load_models  # noqa: E402
from flashdraft.cli import build_parser  # noqa: E402
from flashdraft.demo import load_heldout_prompts  # noqa: E402
from flashdraft.engine import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num", type=int, default=8)
    args = p.parse_args(argv)
    demo_args = build_parser().parse_args(["demo", "--threads", "1"])
    apply_threads(demo_args)
    target, tokenizer, drafter = load_models(demo_args, "")
    engine = engine_from_args(demo_args, target, drafter, tokenizer)
    engine.warmup(1)
    body, total = defaultdict(list), defaultdict(list)

    def record(t) -> None:  # instead of the cost model: these forced cycles are the measurement
        body[t.verified_tokens].append(1000 * (t.total_s - t.draft_s - t.context_s))
        total[t.verified_tokens].append(1000 * t.total_s)

    engine.costs.record = record
    with torch.inference_mode():
        for text in load_heldout_prompts(args.num):
            batch = engine.open_batch()
            engine.add(batch, [tokenizer(text, add_special_tokens=False)["input_ids"]],
                       SamplingParams(max_new_tokens=1000))
            for _ in range(6):
                for width in (1, 2, 4, 8, 16, 16, 8, 4, 2, 1):
                    engine._cycle(batch, forced_width=width, profile=True)
    print("| verify width | cycle ms | body ms | cycles |\n|---|---|---|---|")
    for width in sorted(body):
        print(f"| {width} | {statistics.median(total[width]):.2f} | {statistics.median(body[width]):.2f} | "
              f"{len(body[width])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
