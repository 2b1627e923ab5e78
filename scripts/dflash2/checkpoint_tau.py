"""The training-time held-out tau of a drafter checkpoint, computed as `flashdraft train --eval-every` computes it
(`flashdraft.train.evaluate.evaluate_tau`: greedy, fixed draft policy, the first `--limit` held-out prompts, 64 new
tokens, the target in the trainer's dtype, the drafter in float32), for checkpoints whose run logged no eval.

    python scripts/dflash2/checkpoint_tau.py runs/dflash2/run/checkpoints/step-00001000/drafter [--limit 16]

What this script does not know about: training; it only reads the drafter directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft", type=Path)
    ap.add_argument("--target", default=str(ROOT / "flashdraft/assets/default_pair/target"))
    ap.add_argument("--prompts", default=str(ROOT / "flashdraft/assets/default_pair/heldout_prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if not (args.draft / "config.json").is_file():
        ap.error(f"{args.draft}: no config.json (give a drafter directory)")
    import torch

    from flashdraft.loading import load_drafter, load_target, resolve_dtype
    from flashdraft.model import TargetModel
    from flashdraft.train.data import load_prompts
    from flashdraft.train.evaluate import evaluate_tau

    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target, device="cpu", dtype=resolve_dtype(None, "cpu"))
    drafter = load_drafter(args.draft, dtype=torch.float32)
    eos = getattr(tokenizer, "eos_token_id", None)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit)[:args.limit]
    result = evaluate_tau(TargetModel(model, drafter.target_layer_ids), drafter, prompts, args.max_new_tokens,
                          stop_token_ids=(eos,) if isinstance(eos, int) else ())
    print(json.dumps({"draft": str(args.draft), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
