"""Give a trained full-vocabulary drafter a reduced draft vocabulary, without retraining, and save it.

    python scripts/drafter/restrict_vocab.py --vocab-data data/default_pair/regen_train --size 1024 \
        --out runs/drafter_v1024 [--draft DIR] [--target DIR]

The N most frequent response tokens of the regenerated training data (`--vocab-data`, as `flashdraft train
--draft-vocab-size` counts them) become the draft vocabulary; the drafter's read-out becomes those rows of the
target's lm_head (`restrict_drafter`), saved as its own `lm_head.weight` [N, hidden] with EAGLE-3's `d2t` offsets
and `draft_vocab_size` in the config: the layout vLLM's DFlash loader reads. Every other weight is the source
drafter's, in its dtype, so greedy drafts change only where the source would have drafted a token outside the N.
Prints the share of response tokens the N ids cover.

What this script does not know about: whether N is a good size (`vocab_curve.py` measures draft time and tau over
sizes) and training (`flashdraft train --draft-vocab-size` trains the reduced head instead).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.drafter.eval_tau import response_counts, restrict_vocab  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default=None, help="source drafter (default: the shipped one)")
    ap.add_argument("--target", default=None, help="its target (default: the shipped one)")
    ap.add_argument("--vocab-data", type=Path, required=True, help="regenerated training data to count tokens in")
    ap.add_argument("--size", type=int, required=True, help="draft vocabulary size N")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from flashdraft.loading import load_pair
    from flashdraft.model.draft_vocab import draft_targets

    target, tokenizer, drafter = load_pair(args.target, args.draft, "cpu")
    vocab = int(target.config.vocab_size)
    if not 1 <= args.size < vocab:
        ap.error(f"--size must lie in [1, {vocab - 1}] (the target's vocabulary is {vocab})")
    if not args.vocab_data.exists():
        ap.error(f"--vocab-data {args.vocab_data} does not exist")
    counts = response_counts(args.vocab_data, tokenizer, vocab)
    small = restrict_vocab(drafter, target, counts, args.size)
    small.save_pretrained(args.out, dtype=drafter.dtype)
    covered = float(counts[draft_targets(small.d2t)].sum() / counts.sum())
    print(f"saved {args.out}: draft vocabulary {args.size} of {vocab} ids, covering {100 * covered:.2f}% of the "
          f"{int(counts.sum())} response tokens in {args.vocab_data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
