"""What one decode cycle issues, by rows: torch operators, and on CUDA kernel launches, host-device syncs and GPU busy
time, for plain decoding and the drafting engine (fixed block: every row drafts every cycle; the default policy).

For the H200 finding that a 16-row drafting cycle took ~13 plain 16-row steps where the batch-1 trace prices a block
cycle at ~2.2 one-token steps (BENCHMARKS.md, 'cuDNN attention off on CUDA'): on a launch-bound GPU what a cycle
costs is what it issues and where the host waits, so this counts them per cycle at each row count.

    python scripts/gpu/cycle_ops.py --device cuda --rows 1,16,32 [--cudnn-attention] [--json out.json]

What this script does not know about: why an operator is issued (serve_profile.py says which functions wait).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.engine import EngineConfig, SamplingParams, SpecEngine  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402

ENGINES = {"plain": None, "fixed": "fixed", "adaptive": "adaptive"}
# CUDA runtime calls that wait for the device (a `.tolist()` of a GPU tensor is a copy plus a stream sync)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def cycle_counts(events, cycles: int) -> dict:
    """Per-cycle counts from one profile of `cycles` cycles."""
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    out = {"aten_ops": len(top) / cycles,
           "top_ops": dict(collections.Counter(e.name for e in top).most_common(6))}
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")]
    if launches:
        syncs = [e for e in events if e.name.startswith(SYNCS) and not e.name.startswith("cudaMemcpyAsync")]
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        out.update(launches=len(launches) / cycles, syncs=len(syncs) / cycles,
                   gpu_busy_ms=sum(e.device_time for e in kernels) / 1000 / cycles)
    return out


def measure(engine: SpecEngine, prompts: list[list[int]], rows: int, cycles: int, device: str) -> dict:
    """Warm the engine for `rows` rows, run 3 untimed cycles of a fresh batch, then profile `cycles` more."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    engine.warmup(rows)
    batch = engine.open_batch()
    engine.add(batch, (prompts * rows)[:rows], SamplingParams(max_new_tokens=8 + 16 * (cycles + 4)))
    for _ in range(3):
        engine.step(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync()
    with profile(activities=activities) as prof:
        started, done = time.perf_counter(), 0
        while batch.rows and done < cycles:
            engine.step(batch)
            done += 1
        sync()
        seconds = time.perf_counter() - started
    return {"rows": rows, "cycles": done, "ms_per_cycle": round(1000 * seconds / done, 3),
            **cycle_counts(prof.events(), done)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="the pair's dtype (default: the device's, bf16 on GPU)")
    p.add_argument("--rows", default="1,16,32")
    p.add_argument("--cycles", type=int, default=5, help="profiled cycles per cell")
    p.add_argument("--engines", default="plain,fixed,adaptive", help=f"comma-separated among {list(ENGINES)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cudnn-attention", action="store_true",
                   help="let the engines' attention take cuDNN's SDPA backend too (flashdraft/engine/kernels.py)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = args.engines.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    if any(n not in ENGINES for n in names) or min(rows) < 1 or args.cycles < 1:
        p.error("engines among plain,fixed,adaptive; rows and cycles >= 1")
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(None, None, args.device, args.dtype)
    prompts = [tokenizer.encode(q.text) for q in load_prompts("default", 32)]
    results = []
    for name in names:
        policy = ENGINES[name]
        config = EngineConfig(draft_policy=policy or "adaptive", cudnn_attention=args.cudnn_attention)
        for n in rows:
            with SpecEngine(target, None if policy is None else drafter, tokenizer, config) as engine:
                cell = {"engine": name, **measure(engine, prompts, n, args.cycles, args.device)}
            results.append(cell)
            print(json.dumps(cell), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "device": args.device, "torch": torch.__version__,
                                               "cells": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
