"""Per-join cost, interleaved: a running batch of N rows (plain decoding, or the shipped drafter with `dflash`), one
request joining by `add` + `step` (apart), by `step(batch, prompts)` (mixed: it rides the cycle), or no join (step);
medians of 60 each, ms. Usage: python mixcost.py ROWS [dflash]"""
import sys, time, torch, statistics
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from flashdraft import SamplingParams, SpecEngine
from flashdraft.bench.datasets import load_prompts
from flashdraft.loading import load_pair
torch.set_num_threads(1)
target, tok, drafter = load_pair(None, None, "cpu")
prompts = [tok.encode(q.text) for q in load_prompts("default", 64)]
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16
use_d = len(sys.argv) > 2 and sys.argv[2] == "dflash"
eng = SpecEngine(target, drafter if use_d else None, tok)
eng.warmup(rows + 1)
P = SamplingParams(max_new_tokens=1500)
res = {"apart": [], "mixed": [], "step": []}
with torch.inference_mode():
    batch = eng.open_batch()
    eng.add(batch, prompts[:rows], P)
    for _ in range(5): eng.step(batch)
    k = rows
    for it in range(60):
        for mode in (("apart", "mixed", "step") if it % 2 == 0 else ("step", "mixed", "apart")):
            p = prompts[k % len(prompts)]; k += 1
            t = time.perf_counter()
            if mode == "apart":
                eng.add(batch, [p], P, request_ids=[k]); eng.step(batch)
            elif mode == "mixed":
                eng.step(batch, [p], P, request_ids=[k])
            else:
                eng.step(batch)
            res[mode].append(time.perf_counter() - t)
            if mode != "step":
                eng.cancel(batch, k)  # back to `rows` rows
print(rows, "rows", "dflash" if use_d else "plain", {m: round(statistics.median(v) * 1e3, 2) for m, v in res.items()})
