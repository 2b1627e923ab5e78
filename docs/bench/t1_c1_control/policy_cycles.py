"""Throwaway diagnostic (kept as run, stop 71): the default policy's drafting cycles at batch 1, one per line: how it
decided (plan / probe / refresh), the row's wait, the widths planned and verified, drafts accepted, the cycle's
predicted and measured ms beside a one-token step's, and the row's per-position acceptance estimates; plus the
ratio to plain decoding per round (16 held-out prompts x 64 tokens, one thread, seeds as engine_concurrency.py).

    python docs/bench/t1_c1_control/policy_cycles.py [DRAFT_DIR|default] [TEMPERATURE]
"""
import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts" / "speed"))

from engine_concurrency import build_engine, serve, set_prompts, warm
from flashdraft.loading import load_pair
from flashdraft.engine import policy as P
torch.set_num_threads(1)
draft = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "default" else None
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
target, tok, drafter = load_pair(None, draft, "cpu", None)
prompts = set_prompts(tok, "held-out", 16)
log = []
orig_w, orig_o = P.AdaptiveWidth.widths, P.AdaptiveWidth.observe
def widths(self, rows, pending=None):
    pre = [(r.probing, r.plain_run, r.plain_steps, r.first) for r in rows]
    w = orig_w(self, rows, pending)
    if any(x > 1 for x in w):
        r = rows[0]
        g = r.gains(self.drafting_widths)
        n = len(rows)
        pend = int(pending[0]) if pending is not None else 0
        est = {int(wd): (round(float(n + gi), 2), float(self.costs.cycle(n + wd - 1, int(ln), pend) or 0) * 1e3)
               for wd, ln, gi in zip(self.drafting_widths, self.draft_lengths, g)}
        self._diag = dict(decision=self.decision, pre=pre, w=w, plain_ms=float(self.costs.cycle(n, 0)) * 1e3,
                          est=est, acc=np.round(r.acceptance[:6], 2).tolist(), pending=pend)
    else:
        self._diag = None
    return w
def observe(self, rows, widths, accepted, timing):
    if getattr(self, "_diag", None) is not None and timing is not None:
        d = self._diag; d["accepted"] = accepted; d["actual_ms"] = timing.total_s * 1e3; d["final_w"] = widths
        log.append(d)
    return orig_o(self, rows, widths, accepted, timing)
P.AdaptiveWidth.widths, P.AdaptiveWidth.observe = widths, observe
engine = build_engine(target, tok, drafter, "adaptive")
plain = build_engine(target, tok, None, None)
warm(engine, prompts, 1, temp); warm(plain, prompts, 1, temp)
for rnd in range(2):
    t0 = time.perf_counter(); tk, s, taus, firsts = serve(engine, prompts, 1, 64, temp)
    t1 = time.perf_counter(); tk2, s2, *_ = serve(plain, prompts, 1, 64, temp)
    print(f"round {rnd}: dflash {tk/s:.1f} tok/s plain {tk2/s2:.1f} ratio {tk/s/(tk2/s2):.3f} drafting cycles so far {len(log)}")
kinds = collections.Counter((d["decision"], d["pre"][0][0]) for d in log)
print(kinds)
for d in log[:60]:
    print(d["decision"], "probe" if d["pre"][0][0] else "", "plain_run", d["pre"][0][1], "first", d["pre"][0][3], "w", d["w"], "->", d["final_w"],
          "acc", d["accepted"], "plain %.1f actual %.1f" % (d["plain_ms"], d["actual_ms"]), "pend", d["pending"],
          "est", {k: v for k, v in d["est"].items() if k == d["w"][0]}, "accest", d["acc"])
