"""Throwaway diagnostic of this session (kept as run): the default-policy engine and plain decoding serve
engine_concurrency.py's queue in lockstep, twice; the drafting engine's cycles are traced (`SpecEngine.cycle_trace`)
and summed by kind (row bucket, plain / probe / drafting, lookups, joins, the policy's decision), 16-row cycles
by the number of distinct verify widths, and the cost model's body points printed.

    python docs/bench/lockstep_s47/cycle_kinds.py bfloat16 16 [held-out|out-of-domain]
"""
import sys, json, collections, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "scripts" / "speed"))
import engine_concurrency as ec
from flashdraft.loading import load_pair
from flashdraft.bench.datasets import load_prompts
torch.set_num_threads(1)
dtype = sys.argv[1]; conc = int(sys.argv[2]); setname = sys.argv[3] if len(sys.argv) > 3 else "held-out"
target, tok, drafter = load_pair(None, None, "cpu", dtype)
per = max(1, 32 // len(ec.SETS[setname]))
prompts = [tok.encode(q.text) for spec in ec.SETS[setname] for q in load_prompts(spec, per)]
eng = ec.build_engine(target, tok, drafter, "adaptive")
plain = ec.build_engine(target, tok, drafter, None)
for e in (eng, plain):
    e.warmup(conc); ec.serve(e, prompts[:conc], conc, 8, 0.0)
recs = []; precs = []
eng.cycle_trace = recs.append
plain.cycle_trace = precs.append
for r in range(2):
    res = ec.serve_lockstep({"a": eng, "p": plain}, prompts, conc, 64, 0.0)
    a, p = res["a"], res["p"]
    print(f"round {r}: adaptive {a.tokens/a.seconds:.1f} tok/s, plain {p.tokens/p.seconds:.1f} tok/s, ratio {a.tokens/a.seconds/(p.tokens/p.seconds):.3f}")
# summarise cycles
by = collections.defaultdict(lambda: [0, 0.0, 0])
for c in recs:
    rows = len(c["requests"]); drafting = sum(w > 1 for w in c["widths"])
    kind = "plain" if drafting == 0 else ("probe1" if drafting == 1 else f"draft{min(drafting,99)}")
    if c["lookups"]: kind += "+lk"
    if c["joined"]: kind += "+join"
    key = (ec.policy_module.bucket(rows), kind, c["decision"])
    committed = rows + sum(c["accepted"])
    by[key][0] += committed; by[key][1] += c["ms"] / 1000; by[key][2] += 1
tot_s = sum(v[1] for v in by.values())
for k, (t, s, n) in sorted(by.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"rows~{k[0]:3d} {k[1]:14s} {str(k[2]):12s} cycles {n:5d} tok/s {t/s:8.1f} ms/cycle {1000*s/n:7.2f} share {s/tot_s:5.1%}")

def summary(rs, name):
    join_s = sum(c["ms"] for c in rs if c["joined"]) / 1000
    tot = sum(c["ms"] for c in rs) / 1000
    toks = sum(len(c["requests"]) + sum(c["accepted"]) for c in rs)
    joins = sum(1 for c in rs if c["joined"]); joined = sum(c["joined"] for c in rs)
    lk = [c for c in rs if c["lookups"]]
    print(f"{name}: cycles {len(rs)} total {tot:.2f}s tokens {toks} tok/s {toks/tot:.0f}; join cycles {joins} (rows joined {joined}) {join_s:.2f}s; lookup cycles {len(lk)} {sum(c['ms'] for c in lk)/1000:.2f}s; drafting cycles {sum(1 for c in rs if any(w>1 for w in c['widths']))} {sum(c['ms'] for c in rs if any(w>1 for w in c['widths']))/1000:.2f}s")
    rowsum = collections.Counter()
    for c in rs: rowsum[ec.policy_module.bucket(len(c['requests']))] += c['ms']/1000
    print("   time by rows bucket:", {k: round(v,2) for k,v in sorted(rowsum.items())})
summary(recs, "adaptive"); summary(precs, "plain")
print("---- 16-row cycles without joins or drafts: ms by distinct widths")
import numpy as np
grp = collections.defaultdict(list)
for c in recs:
    if len(c["requests"]) != conc or c["joined"] or any(w > 1 for w in c["widths"]): continue
    g = 1 + len(set(c["lookups"])) if c["lookups"] else 1
    tokens = conc + sum(v - 1 for v in c["lookups"])
    grp[g].append((tokens, c["ms"]))
for g, v in sorted(grp.items()):
    t = np.array(v)
    print(f"groups {g}: cycles {len(v)} tokens mean {t[:,0].mean():.1f} ms median {np.median(t[:,1]):.2f}")
print("body points (bucket: mean tokens, ms):", {k: (round(x,1), round(1000*y,2)) for k,(x,y) in sorted(eng.costs.body.points.items())})
print("draft points:", {k: (round(x,1), round(1000*y,2)) for k,(x,y) in sorted(eng.costs.draft.points.items())})
b16 = eng.costs.body_for(conc) if hasattr(eng.costs, "body_for") else eng.costs.body
print("rows-bucket body points:", {k: (round(x,1), round(1000*y,2)) for k,(x,y) in sorted(b16.points.items())}, "window16", [round(1000*y,2) for _, y in b16.window.get(16, [])], "window32", [ (x, round(1000*y,2)) for x, y in b16.window.get(32, [])])
rate = conc / b16(conc)
print("16-row one-token rate tok/ms", rate/1000, "priced extra ms for +4 / +8 / +16 tokens:", [round(1000*(b16(conc+k)-b16(conc)),2) for k in (4,8,16)])
