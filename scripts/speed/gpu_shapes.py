"""Step times of a Qwen3-8B-shaped target (random weights, bf16) and a 5-layer DFlash drafter, and the speedup
they imply: one AR step, one 16-token verify and one draft (context write + block forward + lm_head), at batch
1, 4 and 16, eager and compiled (CUDA graphs on GPU). Run it on the GPU machine:

    python scripts/speed/gpu_shapes.py --json runs/gpu_shapes.json
    python scripts/speed/gpu_shapes.py --tiny --device cpu          # a scaled-down smoke run (what CI does)

The steps are the engine's own (`PagedTargetKV.forward_block`, `DFlashProposer.propose`) on static caches holding
`--context` positions. Projected speedup at acceptance length tau (default: measured on the shipped pair by
this script, greedy, held-out prompts) = tau * t_AR / (t_draft + t_verify): what the engine would gain if the
rest of a cycle (acceptance, bookkeeping) were free; the CPU profile puts that rest at a few percent.

What this script does not know about: real weights (acceptance needs a trained drafter for the real target; random
weights only fix the shapes and therefore the times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.engine.compiled import compile_step
from flashdraft.engine.batch import Features, RowBuckets
from flashdraft.engine.proposers import DFlashProposer, ProposalInput
from flashdraft.engine.target_kv import PagedTargetKV
from flashdraft.model import DFlashDraftModel, TargetModel, default_target_layer_ids, make_draft_config
from flashdraft.model.fast_target import FastTarget

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)


def build_pair(shape: dict, draft_layers: int, block_size: int, device: str, dtype: torch.dtype):
    config = Qwen3Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build directly in the target dtype: 8B params in fp32 would be 32 GB
        try:
            model = Qwen3ForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(previous)
    target = TargetModel(model)
    taps = default_target_layer_ids(config.num_hidden_layers, draft_layers)
    drafter = DFlashDraftModel(make_draft_config(config, num_layers=draft_layers, block_size=block_size,
                                                 target_layer_ids=taps, mask_token_id=config.vocab_size - 1))
    drafter = drafter.to(device=device, dtype=dtype).eval()
    target.set_layer_ids(drafter.target_layer_ids)
    return target, drafter


def timed_ms(fn, iters: int, device: torch.device) -> float:
    """Median wall time of fn() in ms over `iters` runs, after warm-up runs (which also compile)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


@torch.inference_mode()
def measure(target: TargetModel, drafter: DFlashDraftModel, batch: int, context: int, block: int,
            compiled: bool, iters: int) -> dict:
    dev = target.device
    fast = FastTarget(target)
    capacity = context + 2 * block
    forward = compile_step(fast.forward, dev) if compiled else None
    vocab = target.vocab_size
    kv = PagedTargetKV(fast, fast.new_cache(batch, capacity), batch, RowBuckets(), forward)
    hidden = target.config.hidden_size * len(drafter.target_layer_ids)
    ids = torch.randint(0, vocab - 1, (batch, block), device=dev)
    positions = context + torch.arange(block, device=dev)[None].expand(batch, -1).contiguous()
    end = context + block

    ar = timed_ms(lambda: kv.forward_block(ids[:, :1], positions[:, :1].contiguous(), False, context + 1), iters, dev)
    verify = timed_ms(lambda: kv.forward_block(ids, positions, True, end), iters, dev)

    proposer = DFlashProposer(drafter, target, compile=compiled)
    state = proposer.new_batch_state()
    state.kv = drafter.new_cache(batch, capacity)
    features = torch.randn(batch, block, hidden, device=dev, dtype=drafter.dtype)
    inp = ProposalInput(ids[:, 0], positions, context, Features(
        features, positions - block, torch.ones(batch, block, dtype=torch.bool, device=dev)))
    draft = timed_ms(lambda: proposer.propose(state, inp, block), iters, dev)
    return {"batch": batch, "compiled": compiled, "ar_ms": ar, "verify_ms": verify, "draft_ms": draft,
            "cycle_over_ar": (verify + draft) / ar}


def measure_tau(device: str, num_prompts: int) -> float:
    """Mean acceptance length of the shipped default pair on its held-out prompts (greedy, 128 new tokens)."""
    from flashdraft.demo import load_heldout_prompts
    from flashdraft.engine import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair

    model, tok, drafter = load_pair(device=device, dtype="float32")
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in load_heldout_prompts(num_prompts)]
    results = SpecEngine(model, drafter, draft_policy="fixed").generate(prompts, SamplingParams(max_new_tokens=128,
                                                                          stop_token_ids=(tok.eos_token_id,)))
    lengths = [a for r in results for a in r.stats.acceptance_lengths]
    return sum(lengths) / len(lengths)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="a scaled-down model instead of the 8B shapes (smoke test)")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024, help="positions already in the caches")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    ap.add_argument("--tau", type=float, default=None, help="acceptance length to project with (default: measured)")
    ap.add_argument("--tau-prompts", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    target, drafter = build_pair(TINY if args.tiny else QWEN3_8B, args.draft_layers, args.block_size, args.device,
                                 dtype)
    n_target = sum(p.numel() for p in target.model.parameters()) / 1e9  # billions
    tau = args.tau if args.tau is not None else measure_tau(args.device, args.tau_prompts)
    rows = []
    for mode in args.modes.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            row = measure(target, drafter, batch, args.context, args.block_size, mode == "compiled", args.iters)
            row["projected_speedup"] = tau / row["cycle_over_ar"]
            rows.append(row)
            print(f"  {mode:8s} batch {batch:3d}: AR {row['ar_ms']:.2f} ms, verify {row['verify_ms']:.2f} ms, "
                  f"draft {row['draft_ms']:.2f} ms", flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\n{'tiny' if args.tiny else 'Qwen3-8B'}-shaped target ({n_target:.3g}B params, random {args.dtype}) + "
          f"{args.draft_layers}-layer drafter, block {args.block_size}, {args.context} cached positions, "
          f"{device_name}; tau {tau:.2f} (default pair, greedy)\n")
    print("| mode | batch | AR step ms | 16-token verify ms | draft ms | cycle / AR step | projected speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'compiled' if r['compiled'] else 'eager'} | {r['batch']} | {r['ar_ms']:.2f} | {r['verify_ms']:.2f} "
              f"| {r['draft_ms']:.2f} | {r['cycle_over_ar']:.2f} | {r['projected_speedup']:.2f}x |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": device_name, "tau": tau, "rows": rows,
                                               "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
