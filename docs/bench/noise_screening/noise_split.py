"""Where the counter-based noise's time goes at 16 rows x 1 position x 8,192 tokens (a one-token step), median
microseconds per call, one thread.

    python docs/bench/noise_screening/noise_split.py
"""
import time, statistics, torch, numpy as np
torch.set_num_threads(1)
from flashdraft.engine import noise as N
seeds = torch.arange(16, dtype=torch.long) * 7919 + 13
first = torch.full((16,), 100, dtype=torch.long)
V = 8192
def t(f, n=200):
    for _ in range(10): f()
    ts = []
    for _ in range(n):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6
key = N.slot_keys(seeds, first, 1)
draws = N._draws_numpy(key, V)
E = N.exponential(draws.clone())
temps = torch.ones(16)
print("slot_keys us", t(lambda: N.slot_keys(seeds, first, 1)))
print("hash (draws_numpy) us", t(lambda: N._draws_numpy(key, V)))
print("exponential tail us", t(lambda: N.exponential(draws.clone())))
print("clone us", t(lambda: draws.clone()))
print("race_offsets us", t(lambda: N.race_offsets(E, temps)))
print("whole exponential_noise us", t(lambda: N.exponential_noise(seeds, first, 1, V)))
def np_tail():
    a = draws.numpy().copy(); a += 0.5; a *= 1.0 / (1 << 24); return a
print("np add+mul us", t(np_tail))
x = draws.clone()
print("torch log_ us", t(lambda: x.clone().log_()))
