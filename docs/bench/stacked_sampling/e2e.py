"""Tokens/s of plain decoding and DFlash (the engine's defaults) with top-k / top-p, `generate` at batch 1 and 16,
16 held-out prompts x 64 tokens, seeded, two rounds with the engines alternating; one checkout (the one on
PYTHONPATH), one thread. Also writes every output's token ids, so two checkouts' texts can be compared.

    PYTHONPATH=CHECKOUT python docs/bench/stacked_sampling/e2e.py OUT.json
"""
import hashlib
import json
import sys
import time

import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.demo import load_heldout_prompts
from flashdraft.loading import load_pair

torch.set_num_threads(1)
target, tok, drafter = load_pair()
prompts = [tok.encode(p) for p in load_heldout_prompts()[:16]]
engines = {"plain": SpecEngine(target, None, tok), "dflash": SpecEngine(target, drafter, tok)}
settings = {"T 1, top-p 0.9": dict(temperature=1.0, top_p=0.9), "T 0.7, top-k 40": dict(temperature=0.7, top_k=40),
            "T 1, top-k 40 + top-p 0.8": dict(temperature=1.0, top_k=40, top_p=0.8)}
out = {}
for setting, kwargs in settings.items():
    for batch in (1, 16):
        seconds, tokens, texts = {n: 0.0 for n in engines}, {n: 0 for n in engines}, {n: [] for n in engines}
        for round_ in range(2):
            for name in (list(engines) if round_ % 2 == 0 else list(engines)[::-1]):
                for start in range(0, 16, batch):
                    group = prompts[start:start + batch]
                    params = [SamplingParams(max_new_tokens=64, seed=start + i, **kwargs) for i in range(len(group))]
                    began = time.perf_counter()
                    results = engines[name].generate(group, params)
                    seconds[name] += time.perf_counter() - began
                    tokens[name] += sum(len(r.token_ids) for r in results)
                    if round_ == 0:
                        texts[name] += [r.token_ids for r in results]
        rate = {n: tokens[n] / seconds[n] for n in engines}
        key = f"{setting}, batch {batch}"
        out[key] = {**{n: round(v, 1) for n, v in rate.items()}, "ratio": round(rate["dflash"] / rate["plain"], 3),
                    "outputs_sha1": {n: hashlib.sha1(json.dumps(texts[n]).encode()).hexdigest()[:12] for n in engines},
                    "dflash_equals_plain": texts["dflash"] == texts["plain"]}
        print(key, out[key], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
