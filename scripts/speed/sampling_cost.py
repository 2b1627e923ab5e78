"""What sampling costs per cycle, apart from the models: the counter-based noise (`noise.exponential_noise`; beside it
the torch form a device runs, which the CPU replaces with numpy's in-place arithmetic, same bits) and the
shared verifier (`verify.verify`) at temperature 0 and 1, for batches of rows x verified positions.

    python scripts/speed/sampling_cost.py [--vocab 8192] [--shapes 1x1,16x1,32x1,4x16,16x16] [--threads 1]
    python scripts/speed/sampling_cost.py --device cuda --vocab 151936      # an 8B-shaped target's vocabulary

Prints the median ms per call of each (after warm-up calls), per shape: a one-token step of b rows is `bx1`, a
drafting cycle of b rows verifying the block `bx16`. Noise is generated only for positions a row has not been given
before (`SpecEngine._noise` keeps the rest), so `bx16` is a row's first drafting cycle, the most it ever costs.

What this script does not know about: the models (`SpecEngine(profile=True)`, `CycleProfiler`, times the phases
of real cycles).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.engine.noise import _draws_torch, exponential, exponential_noise, slot_keys  # noqa: E402
from flashdraft.engine.verify import SamplingParams, verify  # noqa: E402


def median_ms(fn, iters: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()  # a GPU call returns before its kernels finish
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--shapes", default="1x1,16x1,32x1,4x16,16x16", help="rows x positions, comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        p.error(f"--shapes takes rows x positions, e.g. 16x1,4x16; got {args.shapes!r}")
    if args.vocab < 2 or args.iters < 1 or args.threads < 1 or any(len(s) != 2 or min(s) < 1 for s in shapes):
        p.error("--vocab must be >= 2, --iters and --threads >= 1, every shape rows x positions >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"| rows x positions | noise ms | noise, torch form ms | verify T = 0 ms | verify T = 1 ms |  "
          f"(vocab {args.vocab}, {device})")
    print("|---|---|---|---|---|")
    for rows, width in shapes:
        seeds, first = torch.arange(rows), torch.zeros(rows, dtype=torch.long)  # host keys, as the engine has them
        noise_ms = median_ms(lambda: exponential_noise(seeds, first, width, args.vocab, device=device), args.iters,
                             device)
        torch_form_ms = median_ms(  # what a device runs (on the CPU the noise is mixed in numpy)
            lambda: exponential(_draws_torch(slot_keys(seeds, first, width), args.vocab, device)), args.iters, device)
        logits = torch.randn(rows, width, args.vocab, generator=torch.Generator().manual_seed(0)).to(device)
        noise = exponential_noise(seeds, first, width, args.vocab, device=device)
        drafts = logits[:, :-1].argmax(-1)  # drafts the target accepts: the verifier walks every position
        greedy, sampled = [SamplingParams()] * rows, [SamplingParams(temperature=1.0)] * rows
        verify_greedy = median_ms(lambda: verify(logits, drafts, greedy), args.iters, device)
        verify_sampled = median_ms(lambda: verify(logits, drafts, sampled, noise=noise), args.iters, device)
        print(f"| {rows}x{width} | {noise_ms:.3f} | {torch_form_ms:.3f} | {verify_greedy:.3f} | {verify_sampled:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
