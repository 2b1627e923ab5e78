"""Throwaway harness: `target_probs` of this checkout against an earlier checkout's (its source read from CHECKOUT),
outputs compared bit for bit, calls interleaved, one thread.

    python docs/bench/top_p_numpy/target_probs_timing.py CHECKOUT
"""
import time, statistics, torch, sys
torch.set_num_threads(1)
from flashdraft.engine.verify import target_probs
import types
src = open(sys.argv[1] + "/flashdraft/engine/verify.py").read()
fn = src[src.index("def target_probs("):src.index("@dataclass\nclass Verdict")]
ns = {"torch": torch}; exec(fn, ns); old = types.SimpleNamespace(target_probs=ns["target_probs"])
def timeit(fns, iters=100):
    t = {k: [] for k in fns}
    for k, f in fns.items():
        for _ in range(3): f()
    for i in range(iters):
        for k, f in (list(fns.items()) if i % 2 else list(fns.items())[::-1]):
            s = time.perf_counter(); f(); t[k].append(time.perf_counter() - s)
    return {k: round(1e3 * statistics.median(v), 3) for k, v in t.items()}
torch.manual_seed(0)
for shape in [(16, 8192), (1, 8192)]:
    x = torch.randn(*shape) * 3
    for T, p, k in [(1.0, 0.9, 0), (0.7, 0.95, 0), (1.0, 1.0, 20), (1.0, 0.8, 40), (1.0, 1.0, 0)]:
        a, b = target_probs(x, T, p, k), old.target_probs(x, T, p, k)
        same = torch.equal(a, b)
        tm = timeit({"new": lambda: target_probs(x, T, p, k), "old": lambda: old.target_probs(x, T, p, k)})
        print(shape, T, p, k, "equal" if same else "DIFF", tm)
