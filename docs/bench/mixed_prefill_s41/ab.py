"""Joins ridden vs prefilled apart, in the engine_concurrency.py harness: two engines alike but for
mixed_prefill_tokens (512 / 0), 8 interleaved rounds of 32 held-out prompts; counts cycles, joins ridden and prefills
in round 0. Usage: python ab.py CONCURRENCY plain|dflash [varied]  (varied: max_tokens 32-95 per request)"""
import sys, time, torch
import os; ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."); sys.path.insert(0, os.path.join(ROOT, "scripts/speed")); sys.path.insert(0, ROOT)
import engine_concurrency as ec
from flashdraft.bench.datasets import load_prompts
from flashdraft.loading import load_pair
from flashdraft.engine import generate as G
torch.set_num_threads(1)
target, tok, drafter = load_pair(None, None, "cpu")
conc = int(sys.argv[1]); kind = sys.argv[2]; varied = len(sys.argv) > 3
if varied:
    from flashdraft import SamplingParams
    def serve(engine, prompts, concurrency, max_tokens, temperature):
        queue = list(enumerate(prompts)); batch = engine.open_batch(); tokens = 0; t0 = time.perf_counter()
        while queue or batch.rows:
            joining = [queue.pop(0) for _ in range(min(len(queue), concurrency - len(batch.rows)))]
            params = [SamplingParams(max_new_tokens=max(1, max_tokens // 2 + (37 * i) % max_tokens)) for i, _ in joining]
            evs = engine.step(batch, [p for _, p in joining], params, request_ids=[i for i, _ in joining]) if joining else engine.step(batch)
            tokens += sum(len(e.result.token_ids) for e in evs if e.finished)
        return tokens, time.perf_counter() - t0, [], []
    ec.serve = serve
prompts = [tok.encode(q.text) for q in load_prompts("default", 32)]
pol = None if kind == "plain" else "adaptive"
engines = {"mixed": ec.build_engine(target, tok, drafter, pol), "apart": ec.build_engine(target, tok, drafter, pol, mixed_prefill_tokens=0)}
counts = {}
orig_cycle = G.SpecEngine._cycle
def cyc(self, batch, *a, joining=(), **k):
    c = counts.setdefault(id(self), [0, 0]); c[0] += 1; c[1] += len(joining)
    return orig_cycle(self, batch, *a, joining=joining, **k)
G.SpecEngine._cycle = cyc
orig_prefill = G.SpecEngine._prefill
pre = {}
def prefill(self, rows, resume=False):
    pre[id(self)] = pre.get(id(self), 0) + 1
    return orig_prefill(self, rows, resume)
G.SpecEngine._prefill = prefill
for e in engines.values():
    e.warmup(conc); ec.serve(e, prompts[:conc], conc, 8, 0.0)
tot = {k: [0, 0.0] for k in engines}
for r in range(8):
    for k, e in (list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]):
        counts[id(e)] = [0, 0]; pre[id(e)] = 0
        n, s, _, _ = ec.serve(e, prompts, conc, 64, 0.0)
        tot[k][0] += n; tot[k][1] += s
        if r == 0: print(k, "cycles", counts[id(e)][0], "joins ridden", counts[id(e)][1], "prefills", pre[id(e)], "%.0f tok/s" % (n / s))
print({k: round(v[0] / v[1]) for k, v in tot.items()}, "mixed/apart %.3f" % ((tot["mixed"][0] / tot["mixed"][1]) / (tot["apart"][0] / tot["apart"][1])))
