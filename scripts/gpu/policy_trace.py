"""What the adaptive draft policy saw and chose, cycle by cycle, on the demo's prompts: for the GPU finding where
the bf16 shipped pair on an H100 never drafted (0 drafting cycles in 1,016 tokens) and its one-token steps ran at
0.39x plain decoding, while fp32 drafted (tau 6.8, 2.9x).

Per prompt: the widths chosen, one-token steps, tau, seconds per token of the drafting engine and of plain decoding
through the same engine; at the end the policy's cost curves (seconds by tokens verified, positions drafted,
context positions written), what the plan would predict for a one-token step and a full block, and both engines'
per-phase profiles (draft, target, verify, commit; synchronised at every phase, so slower than headline speed).

    python scripts/gpu/policy_trace.py --device cuda --dtype bfloat16 [--warmup] [--json runs/policy_trace.json]
    python scripts/gpu/policy_trace.py --device cpu --dtype float32 --cold-ms 200   # a cold timing, on purpose

`--cold-ms` adds that much to the cost model's copy of the second drafting cycle's time (the first kept timing of a
block cycle), as a cold kernel load or a preempted process would: the policy must still draft afterwards.

What this script does not know about: why a cost is what it is (it reports, it does not fix).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flashdraft.demo import load_heldout_prompts
from flashdraft.engine import EngineConfig, SamplingParams, SpecEngine
from flashdraft.engine.policy import CostModel, CycleTiming
from flashdraft.loading import load_pair


def curve_points(curve) -> dict[str, list[float]]:
    return {str(k): [round(x, 1), round(1000 * y, 3)] for k, (x, y) in sorted(curve.points.items())}


def inject_cold_timing(costs: CostModel, seconds: float) -> None:
    """The second drafting cycle this cost model records took `seconds` longer (the engine's timing is untouched)."""
    record, drafting = costs.record, []

    def cold(t: CycleTiming) -> None:
        if t.drafted_tokens:
            drafting.append(t)
            if len(drafting) == 2:
                t = CycleTiming(t.verified_tokens, t.drafted_tokens, t.draft_s, t.total_s + seconds, t.context_tokens,
                                t.context_s)
        record(t)

    costs.record = cold


def timed(engine: SpecEngine, ids: list[int], params: SamplingParams):
    started = time.perf_counter()
    result = engine.generate([ids], params)[0]
    return result, time.perf_counter() - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--warmup", action="store_true", help="run SpecEngine.warmup(1) first, as `serve` does")
    p.add_argument("--cold-ms", type=float, default=0.0, help="one cold timing of a block cycle (see above)")
    p.add_argument("--json", default=None)
    p.add_argument("--cudnn-attention", action="store_true",
                   help="let the engines' attention take cuDNN's SDPA backend too (left out by default on CUDA: it "
                        "plans a graph per new shape; flashdraft/engine/kernels.py)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(None, None, args.device, args.dtype)
    config = EngineConfig(profile=True, cudnn_attention=args.cudnn_attention)
    spec = SpecEngine(target, drafter, tokenizer, config)
    plain = SpecEngine(target, None, tokenizer, config)
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in load_heldout_prompts(args.num_prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    if args.cold_ms:
        inject_cold_timing(spec.costs, args.cold_ms / 1000)
    if args.warmup:
        spec.warmup(1)
    spec.generate(encoded[:1], SamplingParams(max_new_tokens=8))  # the demo's warm-up
    plain.generate(encoded[:1], SamplingParams(max_new_tokens=8))
    print(f"after warm-up: body {curve_points(spec.costs.body)}, draft {curve_points(spec.costs.draft)}, "
          f"context {curve_points(spec.costs.context)}  (bucket: [mean size, ms])")
    spec.profiler.reset()
    plain.profiler.reset()
    prompts = []
    for i, ids in enumerate(encoded):
        ours, ours_s = timed(spec, ids, params)
        base, base_s = timed(plain, ids, params)
        s = ours.stats
        widths = sorted(set(s.verify_widths))
        prompts.append({"prompt": i, "prompt_tokens": len(ids), "cycles": len(s.acceptance_lengths),
                        "one_token_steps": s.plain_steps, "tau": round(s.tau, 2), "widths": widths,
                        "ms_per_token": round(1000 * ours_s / len(ours.token_ids), 3),
                        "plain_ms_per_token": round(1000 * base_s / len(base.token_ids), 3),
                        "same_tokens": ours.token_ids == base.token_ids})
        print(prompts[-1], flush=True)
    costs = spec.costs
    block = spec.block_size
    prediction = {"one_token_step_ms": costs.cycle(1, 0), "full_block_ms": costs.cycle(block, block)}
    prediction = {k: None if v is None else round(1000 * float(v), 3) for k, v in prediction.items()}
    report = {"device": str(target.device), "dtype": args.dtype, "threads": torch.get_num_threads(),
              "cold_ms": args.cold_ms, "torch": torch.__version__, "warmup": args.warmup,
              "prompts": prompts, "body_ms": curve_points(costs.body), "draft_ms": curve_points(costs.draft),
              "context_ms": curve_points(costs.context), "prediction": prediction,
              "profile_drafting": spec.profiler.report(), "profile_plain": plain.profiler.report()}
    for key in ("body_ms", "draft_ms", "context_ms", "prediction", "profile_drafting", "profile_plain"):
        print(f"{key}: {report[key]}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
