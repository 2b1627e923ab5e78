"""Where served time goes, per engine: plain decoding, the drafting engine held at one-token steps (`never`) and
the default policy (`adaptive`), each serving the same queue at one concurrency (`engine_concurrency.serve`).

For the H200 finding that plain decoding through our engine ran at a fifth of the drafting engine held at one-token
steps at 32 requests (1,220 against 5,963 tokens/s), where on CPU the two are level: per engine, its tokens/s, the
Python functions by cumulative time (cProfile; a GPU sync is charged to the function that waits) and torch's
operators by self CPU time and by self device time (torch.profiler).

    python scripts/gpu/serve_profile.py --device cuda --concurrency 32 [--out runs/serve_profile]

What this script does not know about: why (it reports where).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402
from engine_concurrency import SETS, build_engine, serve  # noqa: E402

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--set", default="held-out", choices=list(SETS))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--engines", default="plain,never,adaptive")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=25, help="rows of each table printed")
    p.add_argument("--out", default="runs/serve_profile", help="folder for the full tables")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="let the engines' attention take cuDNN's SDPA backend too (left out by default on CUDA: it "
                        "plans a graph per new shape; flashdraft/engine/kernels.py)")
    args = p.parse_args(argv)
    engine_concurrency.ENGINE_OPTIONS["cudnn_attention"] = args.cudnn_attention
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, tokenizer, drafter = load_pair(None, None, args.device)
    per = max(1, args.num_prompts // len(SETS[args.set]))
    prompts = [tokenizer.encode(q.text) for spec in SETS[args.set] for q in load_prompts(spec, per)]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for name in args.engines.split(","):
        engine = build_engine(target, tokenizer, drafter, None if name == "plain" else name)
        engine.warmup(args.concurrency)
        serve(engine, prompts[:args.concurrency], args.concurrency, 8, args.temperature)  # first launches, untimed
        sync()
        t = time.perf_counter()
        n = serve(engine, prompts, args.concurrency, args.max_tokens, args.temperature)[0]
        sync()
        print(f"=== {name}: {n / (time.perf_counter() - t):.1f} tok/s (unprofiled)", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        serve(engine, prompts, args.concurrency, args.max_tokens, args.temperature)
        sync()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
        (out / f"{name}_cprofile.txt").write_text(text.getvalue())
        lines = [ln for ln in text.getvalue().splitlines() if "/flashdraft/" in ln or "{method" in ln]
        print("\n".join(lines[:args.top]))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            serve(engine, prompts, args.concurrency, args.max_tokens, args.temperature)
            sync()
        by_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40)
        (out / f"{name}_ops.txt").write_text(by_cpu + "\n\n" + prof.key_averages().table(
            sort_by="self_device_time_total" if args.device.startswith("cuda") else "cpu_time_total", row_limit=40))
        print("\n".join(by_cpu.splitlines()[:args.top + 4]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
