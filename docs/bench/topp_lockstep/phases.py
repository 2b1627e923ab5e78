"""Throwaway diagnostic (kept as run): plain decoding, the drafting engine held at one-token steps (`never`) and the
default engine serve engine_concurrency.py's queue in lockstep; every cycle's phases (`SpecEngine.profiler`: draft =
plan, lookups, noise and the draft; target; verify; commit) are recorded with its trace and summed by kind (one-token
steps, with lookup copies, with joins, drafting rows), with what the copies and drafts gave.

    python docs/bench/topp_lockstep/phases.py CONCURRENCY SET TEMPERATURE TOP_P ROUNDS [MAX_TOKENS: N or LO-HI]

Per kind also the tokens committed per ms and the mean rows per cycle (a drained batch has fewer rows).
"""
import collections
import statistics
import sys

import torch

sys.path.insert(0, "scripts/speed")
import engine_concurrency as ec
from flashdraft.loading import load_pair
from flashdraft.bench.datasets import load_prompts
torch.set_num_threads(1)
PHASES = ("draft", "target", "verify", "commit")
conc, setname, T, TP = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
target, tok, drafter = load_pair(None, None, "cpu")
per = 32 // len(ec.SETS[setname])
prompts = [tok.encode(q.text) for spec in ec.SETS[setname] for q in load_prompts(spec, per)]
lengths = ec.request_lengths(sys.argv[6] if len(sys.argv) > 6 else "64", len(prompts))
engines = {name: ec.build_engine(target, tok, drafter, policy)
           for name, policy in (("plain", None), ("never", "never"), ("adaptive", "adaptive"))}
recs = {k: [] for k in engines}
for name, eng in engines.items():
    eng.warmup(conc)
    ec.serve(eng, prompts[:conc], conc, 8, T, None, TP)
    prof = eng.profiler
    prof.enabled = True
    cur = {}

    def mark(phase, prof=prof, cur=cur):  # each phase's time, kept per cycle instead of summed
        now = prof._now()
        cur[phase] = cur.get(phase, 0.0) + now - prof._last
        prof._last = now

    def trace(c, cur=cur, name=name):  # the cycle's trace record, with its phases
        recs[name].append((c, dict(cur)))
        cur.clear()

    prof.mark = mark
    eng.cycle_trace = trace
tot = {k: ec.Served() for k in engines}
for r in range(rounds):
    ec.serve_lockstep(engines, prompts, conc, lengths, T, None, tot, top_p=TP)
plain_rate = tot["plain"].tokens / tot["plain"].seconds
print({k: round(v.tokens / v.seconds / plain_rate, 3) for k, v in tot.items()})
for name in engines:
    by, cycles = collections.defaultdict(list), collections.defaultdict(list)
    for c, ph in recs[name]:
        drafting = sum(w > 1 for w in c["widths"])
        kind = (("join " if c["joined"] else "") + ("plain" if drafting == 0 else f"draft{drafting}")
                + ("+lk" if c["lookups"] else ""))
        by[kind].append(ph)
        cycles[kind].append(c)
    for kind, phs in sorted(by.items(), key=lambda kv: -len(kv[1])):
        mean = {p: round(1000 * statistics.mean([ph.get(p, 0) for ph in phs]), 2) for p in PHASES}
        total = sum(sum(ph.values()) for ph in phs) * 1000
        tokens = sum(len(c["widths"]) + sum(c["accepted"]) for c in cycles[kind])
        rows = sum(len(c["widths"]) for c in cycles[kind]) / len(phs)
        print(f"{name:9s} {kind:14s} cycles {len(phs):4d} rows {rows:4.1f} tok/ms {tokens / total:.3f}  "
              f"mean ms {mean} sum {sum(mean.values()):.2f} "
              f"total {total:.0f}")
    lk = [c for c, _ in recs[name] if c["lookups"]]
    print(name, "lookup cycles", len(lk), "copy tokens verified", sum(sum(v - 1 for v in c["lookups"]) for c in lk),
          "accepted in those cycles", sum(sum(c["accepted"]) for c in lk),
          "decisions", collections.Counter(c.get("decision") for c in lk))
    dr = [c for c, _ in recs[name] if any(w > 1 for w in c["widths"])]
    print(name, "drafting cycles", len(dr), "rows drafting", sum(sum(w > 1 for w in c["widths"]) for c in dr),
          "accepted", sum(sum(c["accepted"]) for c in dr),
          "decisions", collections.Counter(c.get("decision") for c in dr))
    print(name, "all cycles", len(recs[name]), "total ms", round(sum(sum(ph.values()) for _, ph in recs[name]) * 1000))
