"""What the adaptive policy itself costs per cycle (`widths` + `observe`, no model) at 4-64 rows, on the cost curves
of a drafting engine warmed up for 64 rows, in a load where drafting loses (drafting cycles are fed back at three
times a one-token step's body: the curves then price drafting dear, as at such loads). Rows are replaced every 64
cycles, as 64-token requests are.

    python docs/bench/served_load_s42/policy_cost.py
"""
import statistics
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import numpy as np, torch
from flashdraft import SpecEngine
from flashdraft.loading import load_pair
from flashdraft.engine.policy import CycleTiming
torch.set_num_threads(1)
target, tok, drafter = load_pair(None, None, 'cpu')
eng = SpecEngine(target, drafter, tok)
eng.warmup(64)
rng = np.random.default_rng(0)
for n in (4, 16, 32, 64):
    pol = eng.open_batch().policy
    rows = [pol.new_row(False) for _ in range(n)]
    per = []
    drafted_cycles = 0
    for c in range(2000):
        if c % 64 == 0:  # a generation ends: fresh rows, as requests are replaced
            rows = [pol.new_row(False) for _ in range(n)]
        t = time.perf_counter()
        w = pol.widths(rows, [1] * n)
        acc = [int(min(rng.geometric(0.4) - 1, x - 1)) if x > 1 else 0 for x in w]
        drafting = max(w) > 1
        drafted_cycles += drafting
        # one-token steps cost what warm-up measured; drafting cycles twice their worth (drafting loses)
        body = float(eng.costs.cycle(sum(w), 0))
        timing = CycleTiming(sum(w), (16 * sum(x > 1 for x in w)) if drafting else 0, 0.004 if drafting else 0.0,
                             body * (3 if drafting else 1))
        pol.observe(rows, w, acc, timing)
        per.append(time.perf_counter() - t)
    print(f'{n} rows: policy per cycle median {statistics.median(per) * 1e6:.0f} us, '
          f'mean {statistics.mean(per) * 1e6:.0f} us, drafting cycles {drafted_cycles}/2000')
