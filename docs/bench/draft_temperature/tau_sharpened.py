"""`scripts/drafter/eval_tau.py` with the drafter's race run on a sharpened or flattened marginal: each sampled row
drafts from softmax(k * logits / T) instead of softmax(logits / T) (k > 1 sharper, k < 1 flatter; greedy rows are
their argmax either way). Under the default sampler any draft keeps the output plain decoding's with the same seed,
so only tau moves. A throwaway measurement, not an engine option.

    K=1.5 python docs/bench/draft_temperature/tau_sharpened.py --temperature 1 --num 16 --lengths prompt --out DIR
"""

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import flashdraft.engine.proposers as proposers  # noqa: E402

SCALE = float(os.environ["K"])
unscaled = proposers.marginal


def marginal(logits, inverse_temperature):
    return unscaled(logits, inverse_temperature * SCALE)


proposers.marginal = marginal
sys.argv = ["eval_tau.py"] + sys.argv[1:]
runpy.run_path(str(ROOT / "scripts" / "drafter" / "eval_tau.py"), run_name="__main__")
