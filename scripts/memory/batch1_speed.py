"""Batch-1 greedy tokens/s of the engine on the default pair (CPU defaults): the check that a memory change left
single-request speed alone.

    python scripts/memory/batch1_speed.py [--compile]                     # this checkout
    PYTHONPATH=/path/to/other/checkout python scripts/memory/batch1_speed.py [--compile]   # another engine

8 held-out prompts x 128 new tokens, one request at a time, one thread, after two warm-up requests; prints the
best of two passes (this machine is shared: run the checkouts interleaved, several times). Only the engine's
public API is used, so the same file times an older checkout.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flashdraft.demo import load_heldout_prompts
from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.loading import load_pair


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, tok, drafter = load_pair(device="cpu")
    engine = SpecEngine(target, drafter, tok, compile=args.compile)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in load_heldout_prompts(8)]
    params = SamplingParams(max_new_tokens=128, temperature=0.0)
    for prompt in prompts[:2]:
        engine.generate([prompt], params)
    passes = []
    for _ in range(2):
        start, tokens = time.perf_counter(), 0
        for prompt in prompts:
            tokens += len(engine.generate([prompt], params)[0].token_ids)
        passes.append(tokens / (time.perf_counter() - start))
    print(json.dumps({"compile": args.compile, "tokens_per_s": round(max(passes), 1),
                      "passes": [round(x, 1) for x in passes]}))


if __name__ == "__main__":
    main()
