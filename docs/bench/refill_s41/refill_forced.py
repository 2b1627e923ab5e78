"""Forced pattern on the shipped pair: one drafting cycle (block 16), then 8 one-token cycles, repeated (control:
a one-token cycle in the drafting cycle's place); median one-token cycle time by its index. Usage: python refill_forced.py ROWS"""
import sys, time, torch, statistics
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from flashdraft import SamplingParams, SpecEngine
from flashdraft.bench.datasets import load_prompts
from flashdraft.loading import load_pair
torch.set_num_threads(1)
target, tok, drafter = load_pair(None, None, "cpu")
rows = int(sys.argv[1])
prompts = [tok.encode(q.text) for q in load_prompts("default", 32)]
eng = SpecEngine(target, drafter, tok); eng.warmup(rows)
times = {i: [] for i in range(9)}
with torch.inference_mode():
    for ep in range(60):
        batch = eng.open_batch()
        eng.add(batch, prompts[(ep * rows) % 32:(ep * rows) % 32 + rows] or prompts[:rows], SamplingParams(max_new_tokens=200))
        for rep in range(6):
            draft = (ep + rep) % 2 == 0   # control episodes: a one-token cycle in the drafting cycle's place
            t = time.perf_counter(); eng._cycle(batch, forced_width=16 if draft else 1); d = time.perf_counter() - t
            for i in range(1, 9):
                t = time.perf_counter(); eng._cycle(batch, forced_width=1); s = time.perf_counter() - t
                times[(i if draft else -i)] = times.get((i if draft else -i), []) + [s]
            if not batch.rows: break
med = lambda v: statistics.median(v) * 1e3
print(rows, "rows; after a drafting cycle:", " ".join(f"{med(times[i]):.2f}" for i in range(1, 9)))
print(rows, "rows; after a one-token cycle:", " ".join(f"{med(times[-i]):.2f}" for i in range(1, 9)))
