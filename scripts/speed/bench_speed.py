"""Side-by-side speed of one checkpoint: our engine, plain decoding and transformers' built-in DFlash, interleaved
prompt by prompt (batch 1, greedy), plus a per-phase profile of our cycle. Against z-lab's own `dflash` package
(the peer itself, in a side venv): scripts/speed/bench_zlab.py.

    python scripts/speed/bench_speed.py                      # the shipped default pair, held-out prompts
    python scripts/speed/bench_speed.py --target T --draft D --prompts prompts.jsonl --max-new-tokens 256

Methods: our engine (eager, and compiled with --compile), plain decoding through our engine (block size 1, eager
and compiled), transformers' own `generate` and transformers' built-in DFlash. Prints a
markdown table (tokens/s, ratios to plain decoding and to transformers' DFlash, whether outputs equal the target's
own transformers `generate`: the reference, on its own unpacked weights) and the per-phase cycle profile, and
writes --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.engine.policy import DRAFT_POLICIES
from flashdraft.loading import load_pair
from flashdraft.model.hf_export import (to_transformers_assistant, transformers_dflash_available,
                                        unsupported_by_transformers_assistant)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", help="JSONL with a 'prompt' field (default: the default pair's held-out prompts)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--draft-dtype", default="auto", help="default: the target's; bf16 on a CPU with native bf16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="also time our engine and plain decoding compiled")
    ap.add_argument("--draft-policy", choices=DRAFT_POLICIES, default="adaptive",
                    help="ours: the adaptive policy (the default) or the whole block every cycle")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tok, drafter = load_pair(args.target, args.draft, args.device, args.dtype, args.draft_dtype)
    if args.prompts:
        texts = [json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()]
    else:
        from flashdraft.demo import load_heldout_prompts

        texts = load_heldout_prompts()
    texts = texts[: args.num_prompts]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = tok.eos_token_id
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=(eos,) if eos is not None else ())
    block = args.block_size or drafter.block_size
    engines = {"dflash (ours)": SpecEngine(target, drafter, block_size=block, profile=True,
                                           draft_policy=args.draft_policy),
               "plain decoding": SpecEngine(target, None)}
    if args.compile:
        engines["dflash (ours, compiled)"] = SpecEngine(target, drafter, block_size=block, profile=True, compile=True,
                                                       draft_policy=args.draft_policy)
        engines["plain decoding (compiled)"] = SpecEngine(target, None, compile=True)
    assistant = None  # transformers' DFlash runs the drafter in the target's dtype (it cannot mix them)
    if transformers_dflash_available() and block == drafter.block_size:
        unsupported = unsupported_by_transformers_assistant(drafter)  # it reads DFlash-1 drafters only
        if unsupported:
            print("transformers DFlash skipped: " + "; ".join(unsupported), file=sys.stderr)
        else:
            assistant = to_transformers_assistant(drafter, dtype=target.dtype)

    acceptance = {name: [] for name in engines}  # acceptance lengths of the timed runs

    def engine_runner(name):
        def run(ids):
            result = engines[name].generate([ids], params)[0]
            acceptance[name].extend(result.stats.acceptance_lengths)
            return result.token_ids
        return run

    def run_hf_plain(ids):
        out = target.generate(torch.tensor([ids], device=target.device), max_new_tokens=args.max_new_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
        return out[0, len(ids):].tolist()

    def run_hf(ids):
        out = target.generate(torch.tensor([ids], device=target.device), assistant_model=assistant,
                              speculation_type="dflash", max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
        return out[0, len(ids):].tolist()

    methods = {name: engine_runner(name) for name in engines}
    methods["transformers generate"] = run_hf_plain
    if assistant is not None:
        methods["transformers DFlash"] = run_hf
    for fn in methods.values():  # warm-up (compiled steps: the first call compiles)
        for ids in prompts[:2]:
            fn(ids)
    for name, engine in engines.items():
        engine.profiler.reset()
        acceptance[name].clear()
    totals = {m: [0, 0.0] for m in methods}
    outputs = {m: [] for m in methods}
    for ids in prompts:
        for name, fn in methods.items():
            t0 = time.perf_counter()
            toks = fn(ids)
            totals[name][1] += time.perf_counter() - t0
            totals[name][0] += len(toks)
            outputs[name].append(toks)
    tps = {m: n / s for m, (n, s) in totals.items()}
    reference = [_cut_at(out, eos) for out in outputs["transformers generate"]]
    identical = {m: sum(_cut_at(a, eos) == b for a, b in zip(outputs[m], reference)) for m in methods}
    profiles = {m: e.profiler.report() for m, e in engines.items() if e.block_size > 1}
    tau = sum(acceptance["dflash (ours)"]) / max(len(acceptance["dflash (ours)"]), 1)  # mean acceptance length
    baselines = [b for b in ("plain decoding", "plain decoding (compiled)", "transformers DFlash") if b in tps]
    print(f"\n{len(prompts)} prompts, max {args.max_new_tokens} new tokens, block {block}, batch 1, greedy, "
          f"device {target.device}, target {target.dtype}, our drafter {drafter.dtype}, "
          f"{torch.get_num_threads()} threads; tau {tau:.2f}\n")
    print("| method | tokens/s | " + " | ".join(f"vs {b}" for b in baselines) + " | outputs equal transformers generate |")
    print("|---|---|" + "---|" * len(baselines) + "---|")
    for m in methods:
        ratios = " | ".join(f"{tps[m] / tps[b]:.2f}x" for b in baselines)
        print(f"| {m} | {tps[m]:.1f} | {ratios} | {identical[m]}/{len(prompts)} |")
    for m, profile in profiles.items():
        ms = profile["ms_per_cycle"]
        print(f"\n{m} cycle: {profile['cycle_ms']:.2f} ms = draft {ms['draft']:.2f} + target forward "
              f"{ms['target']:.2f} + verify {ms['verify']:.2f} + commit {ms['commit']:.2f} (verify + commit share "
              f"{100 * (profile['share']['verify'] + profile['share']['commit']):.1f}%)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"tokens_per_second": tps, "identical": identical, "tau": tau,
                                               "profiles": profiles, "block_size": block, "dtype": str(target.dtype),
                                               "num_prompts": len(prompts)}, indent=2))
    return 0 if all(v == len(prompts) for v in identical.values()) else 1


def _cut_at(tokens: list[int], eos) -> list[int]:
    """Tokens up to and including the first EOS (transformers pads finished rows with it)."""
    return tokens[:tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


if __name__ == "__main__":
    sys.exit(main())
