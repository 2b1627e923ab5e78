"""Throwaway diagnostic (kept as run): the per-step cost of plain decoding against the drafting engine held at one-token
steps (`never`) in a steady batch of ROWS rows (no joins, no drain), STEPS steps per pass, five passes alternating.

    python docs/bench/never_steady/never_step.py ROWS STEPS [TEMPERATURE] [--profile]
"""
import sys, time, statistics, cProfile, pstats
import torch
sys.path.insert(0, "scripts/speed"); sys.path.insert(0, ".")
import engine_concurrency as ec
from flashdraft.loading import load_pair
from flashdraft.bench.datasets import load_prompts
from flashdraft.engine import SamplingParams
torch.set_num_threads(1)
rows = int(sys.argv[1]); steps = int(sys.argv[2]); T = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
target, tok, drafter = load_pair(None, None, "cpu")
prompts = [tok.encode(q.text) for q in load_prompts(ec.SETS["held-out"][0], rows)]
engines = {n: ec.build_engine(target, tok, drafter, p) for n, p in (("plain", None), ("never", "never"))}
for e in engines.values():
    e.warmup(rows)
def run(name, prof=None):
    e = engines[name]; b = e.open_batch()
    params = [SamplingParams(max_new_tokens=steps + 8, temperature=T, seed=i if T > 0 else None) for i in range(rows)]
    e.step(b, prompts, params, request_ids=list(range(rows)))
    for _ in range(4): e.step(b)
    if prof: prof.enable()
    t = time.perf_counter()
    for _ in range(steps): e.step(b)
    dt = time.perf_counter() - t
    if prof: prof.disable()
    while b.rows: e.step(b)
    return 1000 * dt / steps
res = {n: [] for n in engines}
for r in range(5):
    for n in (engines if r % 2 == 0 else reversed(list(engines))):
        res[n].append(run(n))
print({n: [round(x, 3) for x in v] for n, v in res.items()})
print({n: round(statistics.median(v), 3) for n, v in res.items()}, "ratio never/plain", round(statistics.median(res["never"]) / statistics.median(res["plain"]), 4))
if "--profile" in sys.argv:
    for n in engines:
        p = cProfile.Profile(); run(n, p)
        print("=====", n); pstats.Stats(p).sort_stats("tottime").print_stats(25)
