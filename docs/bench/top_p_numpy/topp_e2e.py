"""Throwaway harness: tokens/s of plain decoding and DFlash (the engine's defaults) at top-p, `generate` with batch 1
and batch 16, 16 held-out prompts x 64 tokens, seeded, two rounds with the engines alternating; one checkout (the
one on PYTHONPATH), one thread.

    PYTHONPATH=CHECKOUT python docs/bench/top_p_numpy/topp_e2e.py OUT.json
"""
import json, sys, time, torch
torch.set_num_threads(1)
from flashdraft import SamplingParams, SpecEngine
from flashdraft.demo import load_heldout_prompts
from flashdraft.loading import load_pair
target, tok, drafter = load_pair()
prompts = [tok.encode(p) for p in load_heldout_prompts()[:16]]
engines = {"plain": SpecEngine(target, None, tok), "dflash": SpecEngine(target, drafter, tok)}
settings = {"T1 top_p 0.9": dict(temperature=1.0, top_p=0.9), "T0.7 top_p 0.95": dict(temperature=0.7, top_p=0.95),
            "T1": dict(temperature=1.0)}
out = {}
for sname, kw in settings.items():
    for batch in (1, 16):
        times = {n: 0.0 for n in engines}; toks = {n: 0 for n in engines}
        for rnd in range(2):
            for name in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
                eng = engines[name]
                for start in range(0, 16, batch):
                    group = prompts[start:start + batch]
                    params = [SamplingParams(max_new_tokens=64, seed=start + i, **kw) for i in range(len(group))]
                    t = time.perf_counter()
                    res = eng.generate(group, params)
                    times[name] += time.perf_counter() - t
                    toks[name] += sum(len(r.token_ids) for r in res)
        tps = {n: toks[n] / times[n] for n in engines}
        out[f"{sname} batch {batch}"] = {**{n: round(v, 1) for n, v in tps.items()}, "ratio": round(tps["dflash"] / tps["plain"], 3)}
        print(f"{sname} batch {batch}", out[f"{sname} batch {batch}"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
