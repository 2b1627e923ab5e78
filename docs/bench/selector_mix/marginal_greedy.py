"""`scripts/drafter/eval_tau.py` with a DFlash2 drafter's greedy rows drafting their marginal's argmax instead of the
selector's walk (a diagnostic: which cells the selector's pair term helps and which it hurts, same drafter).

    python docs/bench/selector_mix/marginal_greedy.py --draft DIR --num 16 --lengths 1800,prompt --out DIR
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "drafter")]

from flashdraft.engine import dflash2_proposer  # noqa: E402
from flashdraft.model import dflash2  # noqa: E402

walk = dflash2.CandidateSelector.select


def marginal_greedy(self, hidden, logits, anchor, choose, with_scores=True):
    out = walk(self, hidden, logits, anchor, choose, with_scores)
    if choose is dflash2_proposer.greedy_choice:
        out["tokens"] = logits.argmax(-1)
    return out


dflash2.CandidateSelector.select = marginal_greedy
import eval_tau  # noqa: E402

sys.exit(eval_tau.main(sys.argv[1:]))
