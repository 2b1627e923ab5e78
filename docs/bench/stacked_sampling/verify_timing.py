"""`verify` of sampled rows with top-k / top-p under the noise, this checkout's against another's, calls interleaved.

    python docs/bench/stacked_sampling/verify_timing.py OLD_VERIFY_PY [--reps 30]

OLD_VERIFY_PY: the other checkout's flashdraft/engine/verify.py (it imports this checkout's other modules).
Prints median ms per call for rows x block positions x 8,192 logits (one thread), and checks both give the same
verdict on every case."""

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from flashdraft.engine.verify import SamplingParams, verify

parser = argparse.ArgumentParser()
parser.add_argument("old")
parser.add_argument("--reps", type=int, default=30)
parser.add_argument("--vocab", type=int, default=8192)
args = parser.parse_args()
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("verify_other", args.old)
other = importlib.util.module_from_spec(spec)
sys.modules["verify_other"] = other
spec.loader.exec_module(other)

SETTINGS = {"T 1, top-p 0.9": dict(temperature=1.0, top_p=0.9), "T 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95),
            "T 0.7, top-k 40": dict(temperature=0.7, top_k=40),
            "T 1, top-k 40 + top-p 0.8": dict(temperature=1.0, top_k=40, top_p=0.8)}
print(f"| setting | rows x positions | other ms | this ms | ratio |\n|---|---|---|---|---|")
for name, kwargs in SETTINGS.items():
    for rows, width in ((1, 16), (4, 16), (16, 16), (16, 1), (32, 1)):
        gen = torch.Generator().manual_seed(rows * 100 + width)
        logits = torch.randn(rows, width, args.vocab, generator=gen) * 3
        drafts = logits[:, :-1].argmax(-1)
        noise = torch.empty(rows, width, args.vocab).exponential_(generator=gen)
        params = [SamplingParams(**kwargs)] * rows
        a, b = other.verify(logits, drafts, params, noise=noise), verify(logits, drafts, params, noise=noise)
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_tokens, b.next_tokens), name
        times = {"other": [], "this": []}
        for _ in range(args.reps):
            for label, fn in (("other", other.verify), ("this", verify)):
                start = time.perf_counter()
                fn(logits, drafts, params, noise=noise)
                times[label].append(time.perf_counter() - start)
        o, t = (statistics.median(times[x]) * 1e3 for x in ("other", "this"))
        print(f"| {name} | {rows} x {width} | {o:.2f} | {t:.2f} | {t / o:.2f} |", flush=True)
