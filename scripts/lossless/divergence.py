"""How often does speculative output differ from the target's own greedy output, and what does exact mode cost?

Greedy speculative decoding is lossless in exact arithmetic; in floating point a 16-token verify and a one-token
step sum in different orders, so at a near-tie of the top two logits the argmax can flip and the two continuations
part ways. This script measures the rate on real prompts, batch 1, greedy:

- contexts of `--context-tokens` tokens cut from installed packages' sources (`source_contexts`: code the shipped
  pair never saw), half ending mid-line and half at a line start;
- per precision (fp32, bf16): the target's own `generate(do_sample=False)` (transformers, unpacked weights) as the
  reference, then through our engine plain decoding and DFlash, each in the default mode and in exact mode
  (`SpecEngine(exact=True)`);
- reports outputs differing from the reference and from plain decoding in the same mode, where they part ways,
  and tokens/s per method (the cost of exact mode).

    python scripts/lossless/divergence.py --num-prompts 112 --json runs/divergence.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft import DFlashDraftModel, SamplingParams, SpecEngine
from flashdraft.bench.datasets import source_contexts
from flashdraft.bench.reference import first_difference
from flashdraft.loading import DEFAULT_PAIR_DIR
from transformers import AutoModelForCausalLM, AutoTokenizer

METHODS = ("plain", "dflash", "plain-exact", "dflash-exact")


def run_precision(dtype, contexts, args, tokenizer) -> dict:
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval().to(args.device)
    drafter = DFlashDraftModel.from_pretrained(args.draft, dtype=dtype, device=args.device)
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=(eos,) if eos is not None else ())
    engines = {"plain": SpecEngine(target, None, tokenizer), "dflash": SpecEngine(target, drafter, tokenizer),
               "plain-exact": SpecEngine(target, None, tokenizer, exact=True),
               "dflash-exact": SpecEngine(target, drafter, tokenizer, exact=True)}
    outputs = {m: [] for m in ("target-generate",) + METHODS}
    seconds = dict.fromkeys(outputs, 0.0)
    for ids in tqdm(contexts, desc=f"{dtype}", unit="prompt"):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(torch.tensor([ids], device=args.device),
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=args.device),
                                  max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos)
        seconds["target-generate"] += time.perf_counter() - t0
        ref = out[0, len(ids):].tolist()
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        outputs["target-generate"].append(ref)
        for m, engine in engines.items():  # interleaved per prompt, so machine drift hits every method alike
            t0 = time.perf_counter()
            outputs[m].append(engine.generate([ids], params)[0].token_ids)
            seconds[m] += time.perf_counter() - t0
    ref = outputs["target-generate"]
    summary = {"tokens_per_second": {m: sum(map(len, o)) / seconds[m] for m, o in outputs.items()}}
    for m in METHODS:
        diffs = [first_difference(o, r) for o, r in zip(outputs[m], ref)]
        summary[f"{m} vs target-generate"] = {"differ": sum(d is not None for d in diffs),
                                             "first_difference_at": [d for d in diffs if d is not None]}
    for spec, plain in (("dflash", "plain"), ("dflash-exact", "plain-exact")):
        diffs = [first_difference(a, b) for a, b in zip(outputs[spec], outputs[plain])]
        summary[f"{spec} vs {plain}"] = {"differ": sum(d is not None for d in diffs),
                                         "first_difference_at": [d for d in diffs if d is not None]}
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(DEFAULT_PAIR_DIR / "target"))
    p.add_argument("--draft", default=str(DEFAULT_PAIR_DIR / "drafter"))
    p.add_argument("--num-prompts", type=int, default=112)
    p.add_argument("--context-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    half = args.num_prompts // 2
    contexts = (source_contexts(tokenizer, half, args.context_tokens, end_at_line_start=False, seed=0)
                + source_contexts(tokenizer, args.num_prompts - half, args.context_tokens, end_at_line_start=True,
                                  seed=1))
    results = {"num_prompts": len(contexts), "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
               "threads": args.threads, "device": args.device, "precisions": {}}
    for name in args.dtypes.split(","):
        results["precisions"][name] = run_precision(getattr(torch, name), contexts, args, tokenizer)
        s = results["precisions"][name]
        print(f"\n{name}: {len(contexts)} prompts x {args.max_new_tokens} new tokens, greedy, batch 1")
        for key, v in s.items():
            if key != "tokens_per_second":
                print(f"  {key:34s} differ {v['differ']:3d}/{len(contexts)}   first difference at {v['first_difference_at']}")
        print("  tokens/s: " + ", ".join(f"{m} {v:.1f}" for m, v in s["tokens_per_second"].items()))
        if args.json:  # after each precision, so a long run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
