"""The main job: speculative generation on the shipped default pair for held-out prompts, side by side with plain
decoding through the same engine. Prints the generated code, tau, the acceptance histogram, the speedup measured
in this run (methods interleaved prompt by prompt so machine drift cancels), and, greedy, whether every output
equals the target's own greedy output from transformers' `generate` on its unpacked weights (not our engine's
plain decoding, which shares our fast path and kernels: that run is only the speed baseline).

What this module does not know about: other datasets and methods (that is `flashdraft bench`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flashdraft.loading import DEFAULT_PAIR_DIR

HELDOUT_PROMPTS = DEFAULT_PAIR_DIR / "heldout_prompts.jsonl"


def load_heldout_prompts(n: int | None = None) -> list[str]:
    if not HELDOUT_PROMPTS.is_file():
        raise FileNotFoundError(f"{HELDOUT_PROMPTS} is missing (it ships with the default pair)")
    prompts = [json.loads(line)["prompt"] for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    return prompts[:n] if n else prompts


def run(args) -> int:
    import torch

    from flashdraft.args import apply_threads, engine_from_args, histogram_lines, load_models
    from flashdraft.bench.reference import TARGET_GENERATE, TIE_NOTE, compare_with_target, describe_difference
    from flashdraft.engine import RequestStats, SamplingParams

    apply_threads(args)
    prompts = load_heldout_prompts(args.num_prompts)
    target, tokenizer, drafter = load_models(args, " (the demo runs DFlash against plain decoding)")
    if tokenizer is None:
        raise ValueError("the target has no tokenizer; the demo needs one to encode its prompts")
    eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=eos,
                            seed=0 if args.temperature > 0 else None)
    spec = engine_from_args(args, target, drafter, tokenizer)
    plain = engine_from_args(args, target, drafter, tokenizer, plain=True)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    print(f"flashdraft demo: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, drafter "
          f"{drafter.num_parameters() / 1e6:.1f}M params, block {spec.block_size}, {len(prompts)} held-out prompts, "
          f"device {target.device}, torch threads {torch.get_num_threads()}")
    spec.warmup(1)  # as `flashdraft serve` does: every verify width's kernels run, the draft policy's costs timed
    spec.generate(encoded[:1], SamplingParams(max_new_tokens=8))  # warm-up, not timed
    plain.generate(encoded[:1], SamplingParams(max_new_tokens=8))

    rows, total = [], {"dflash": [0, 0.0], "ar": [0, 0.0]}
    merged = RequestStats(spec.block_size, 0)
    greedy = args.temperature == 0
    for i, (text, ids) in enumerate(zip(prompts, encoded)):
        t0 = time.perf_counter()
        ours = spec.generate([ids], params)[0]
        t1 = time.perf_counter()
        base = plain.generate([ids], params)[0]
        t2 = time.perf_counter()
        total["dflash"][0] += len(ours.token_ids)
        total["dflash"][1] += t1 - t0
        total["ar"][0] += len(base.token_ids)
        total["ar"][1] += t2 - t1
        check = compare_with_target(target, ids, params, ours) if greedy else None  # not timed
        merged.acceptance_lengths += ours.stats.acceptance_lengths
        merged.plain_steps += ours.stats.plain_steps
        merged.verify_widths += ours.stats.verify_widths
        row = {"prompt": text, "output": ours.text, "tokens": len(ours.token_ids), "tau": ours.stats.tau,
               "dflash_s": t1 - t0, "ar_s": t2 - t1,
               "identical_to_target_generate": check["identical"] if check else None}
        if check and not check["identical"]:
            row["first_difference_at"] = check["first_difference_at"]
        rows.append(row)
        if i < args.show:
            print(f"\n=== prompt {i + 1} ===\n{text}\033[1m{ours.text}\033[0m")
            same = ("not checked (sampling)" if check is None else "yes" if check["identical"]
                    else f"DIFFER, {describe_difference(check)}")
            print(f"--- {len(ours.token_ids)} tokens, tau {ours.stats.tau:.2f}, identical to {TARGET_GENERATE}: {same}")

    tps = {k: n / s if s > 0 else 0.0 for k, (n, s) in total.items()}
    speedup = tps["dflash"] / tps["ar"] if tps["ar"] else 0.0
    print("\n=== summary ===")
    print(f"tau (mean acceptance length, bonus included): {merged.tau:.2f} over {merged.num_drafts} cycles"
          + (f" (+ {merged.plain_steps} one-token steps)" if merged.plain_steps else "")
          + (f", mean verify width {sum(merged.verify_widths) / merged.num_drafts:.1f}" if merged.num_drafts else ""))
    print("acceptance length histogram:")
    print("\n".join(histogram_lines(merged.histogram)))
    print("per-position acceptance: " + " ".join(f"{x:.2f}" for x in merged.per_position_acceptance))
    print(f"dflash: {tps['dflash']:.1f} tok/s   plain decoding: {tps['ar']:.1f} tok/s   speedup: {speedup:.2f}x")
    same = sum(bool(r["identical_to_target_generate"]) for r in rows)
    all_identical = not greedy or same == len(rows)
    if greedy:
        verdict = "PASS" if all_identical else "DIFFER"
        print(f"losslessness: {verdict} - identical to {TARGET_GENERATE}: {same}/{len(rows)}")
        for i, r in enumerate(rows):
            if not r["identical_to_target_generate"]:
                print(f"  prompt {i + 1}: first difference at token {r['first_difference_at']}")
        if not all_identical:
            print(f"  ({TIE_NOTE})")
    else:
        print(f"losslessness: not checked against {TARGET_GENERATE} (sampling, temperature > 0)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tau": merged.tau, "histogram": merged.histogram,
            "per_position_acceptance": merged.per_position_acceptance, "tokens_per_second": tps, "speedup": speedup,
            "speedup_baseline": "plain decoding through the same engine",
            "identical_to_target_generate": {"identical": same, "compared": len(rows),
                                             "compared_with": TARGET_GENERATE} if greedy else None,
            "prompts": rows}, indent=2))
    return 0 if all_identical else 1
