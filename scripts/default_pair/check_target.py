"""Checks the shipped default target: loads it with the Auto classes and greedily continues held-out prompts.

Usage (from the repository root)::

    python scripts/default_pair/check_target.py [--n 3] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from scripts.default_pair.corpus import heldout_prompts  # noqa: E402

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "flashdraft" / "assets" / "default_pair" / "target"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--n", type=int, default=3, help="number of held-out prompts to continue")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.dir)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    cfg = model.config
    assert tok.eos_token_id == tok.pad_token_id == tok.bos_token_id == cfg.eos_token_id == cfg.pad_token_id
    assert tok.mask_token_id is not None and tok.mask_token_id != tok.eos_token_id
    assert len(tok) == cfg.vocab_size, (len(tok), cfg.vocab_size)
    print(f"[check] loaded {type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} params, "
          f"eos={tok.eos_token_id} mask={tok.mask_token_id} vocab={cfg.vocab_size}")

    for rec in heldout_prompts(args.n, with_meta=True):
        ids = tok(rec["prompt"], return_tensors="pt").input_ids
        t = time.time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False)
        new = out[0, ids.shape[1]:]
        print(f"\n===== {rec['path']}:{rec['lineno']} ({len(new)} tokens in {time.time() - t:.2f}s)")
        print(rec["prompt"], end="")
        print("----- greedy continuation -----")
        print(tok.decode(new, skip_special_tokens=True))


if __name__ == "__main__":
    sys.exit(main())
