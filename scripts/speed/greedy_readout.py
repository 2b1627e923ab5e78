"""What the screened read-out (`model/greedy_readout.py`) changes: plain decoding and DFlash with the target's
full fp32 read-out and with the screened one, in one process, batches interleaved, greedy or (`--temperature`)
sampled under the default sampler's noise, each prompt seeded by its index.

    python scripts/speed/greedy_readout.py [--batch 1,4,16] [--sets default,ood-code,ood-code-nl] [--num-prompts 16]
        [--max-new-tokens 64] [--rounds 3] [--threads 1] [--draft-policy adaptive|fixed] [--temperature 0]
        [--forward-reps 30] [--forward-only] [--json ...]

First the target forward alone (`FastTarget.forward` over `rows` x 1 token, a one-token step, and `rows` x 16
tokens, a drafting cycle's verify, of the first set's prompts after 192 cached positions, capture on; sampled:
with the race that picks the tokens, on softmax(logits / T) after the full read-out, through `race_offsets` before
the screened one), full and screened read-out interleaved call by call, median thread CPU ms: what the read-out
changes without the engine's or the policy's choices (`--forward-only` stops there). Then each batch size runs
each set's prompts as batches of that many rows (`SpecEngine.generate`), the four engines in turn (order reversed
every round; `--draft-policy fixed`: every row verifies the whole block, so the two DFlash engines do the same work
and differ only in the read-out, where the default policy's timing-driven choices differ between them), each timed
by the process's own CPU time (what another process on a shared machine moves least) and by wall time. Every
engine is warmed up for the batch size first, as a server is. Prints per set and batch size tokens/s of each
engine, the two speedups of DFlash over plain decoding (full and screened read-out), and checks that each screened
engine's outputs equal its full twin's token for token.

What this script does not know about: top-k / top-p (those rows keep the full read-out), a server's joins and
leaves (`engine_concurrency.py`), compiled steps (they keep the full read-out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.engine import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.engine.noise import exponential_noise, race, race_offsets  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402

ENGINES = ("plain", "plain_screened", "dflash", "dflash_screened")


def forward_costs(fast, text: list[int], rows_list: list[int], width: int = 16, context: int = 192,
                  reps: int = 30, temperature: float = 0.0) -> list[dict]:
    """Median thread CPU ms of one verify forward with the full and with the screened read-out (`fast.screened`),
    each row a window of real text `text` (the screening's cost follows how peaked the logits are: random tokens
    leave them flat); at a temperature, each with the race that picks the tokens from it."""
    out = []
    for rows in rows_list:
        kv = fast.new_cache(rows, context + width)
        windows = torch.tensor([text[(r * 97) % (len(text) - context - width):][:context + width] for r in range(rows)])
        prompt, block = windows[:, :context], windows[:, context:]
        fast.forward(prompt, torch.arange(context).expand(rows, -1), kv, capture=False, key_len=context)
        positions = torch.arange(context, context + width).expand(rows, -1)
        noise = (exponential_noise(torch.arange(rows), torch.zeros(rows, dtype=torch.long), width,
                                   fast.screened.vocab) if temperature > 0 else None)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(reps + 2):
            for greedy in ((False, True) if i % 2 else (True, False)):
                started = time.thread_time()
                offsets = None
                if noise is not None and greedy:
                    offsets = race_offsets(noise, torch.full((rows,), temperature))
                logits, _ = fast.forward(block, positions, kv, capture=True, key_len=context + width, greedy=greedy,
                                      offsets=offsets)
                if noise is not None and not greedy:
                    race(torch.softmax(logits / temperature, dim=-1), noise)
                if i >= 2:
                    times[greedy].append(time.thread_time() - started)
        full, screened = (1e3 * statistics.median(times[k]) for k in (False, True))
        out.append({"rows": rows, "width": width, "tokens": rows * width, "full_ms": round(full, 3),
                    "screened_ms": round(screened, 3), "ratio": round(screened / full, 3)})
    return out


def measure(engines: dict, prompts: list[list[int]], batch: int, max_new_tokens: int, rounds: int,
            temperature: float = 0.0) -> dict:
    totals = {name: {"cpu_s": 0.0, "wall_s": 0.0, "tokens": 0} for name in engines}
    outputs: dict[str, list] = {name: [] for name in engines}
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=i if temperature > 0 else None) for i in range(len(prompts))]
    for rnd in range(rounds):
        order = list(engines.items()) if rnd % 2 == 0 else list(reversed(engines.items()))
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            for name, engine in order:
                cpu, wall = time.thread_time(), time.perf_counter()
                results = engine.generate(chunk, params[start:start + batch])
                totals[name]["cpu_s"] += time.thread_time() - cpu
                totals[name]["wall_s"] += time.perf_counter() - wall
                totals[name]["tokens"] += sum(len(r.token_ids) for r in results)
                if rnd == 0:
                    outputs[name] += [r.token_ids for r in results]
    cell = {"batch": batch}
    for name, t in totals.items():
        cell[name] = {"tok_s_cpu": round(t["tokens"] / t["cpu_s"], 1), "tok_s_wall": round(t["tokens"] / t["wall_s"], 1)}
    for kind in ("cpu", "wall"):
        key = f"tok_s_{kind}"
        cell[f"speedup_full_{kind}"] = round(cell["dflash"][key] / cell["plain"][key], 3)
        cell[f"speedup_screened_{kind}"] = round(cell["dflash_screened"][key] / cell["plain_screened"][key], 3)
        cell[f"plain_screened_over_full_{kind}"] = round(cell["plain_screened"][key] / cell["plain"][key], 3)
        cell[f"dflash_screened_over_full_{kind}"] = round(cell["dflash_screened"][key] / cell["dflash"][key], 3)
    cell["outputs_equal"] = (outputs["plain"] == outputs["plain_screened"]
                             and outputs["dflash"] == outputs["dflash_screened"])
    return cell


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,4,16", help="batch sizes (comma-separated)")
    ap.add_argument("--sets", default="default,ood-code,ood-code-nl")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-policy", choices=("adaptive", "fixed"), default="adaptive")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, seeded by prompt")
    ap.add_argument("--forward-reps", type=int, default=30, help="interleaved calls per forward timing")
    ap.add_argument("--forward-only", action="store_true", help="the forward timings only, no engines")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if min(batches) < 1 or args.num_prompts < 1 or args.rounds < 1 or args.max_new_tokens < 1:
        ap.error("--batch, --num-prompts, --rounds and --max-new-tokens must be >= 1")
    if not 0 <= args.temperature <= 100:
        ap.error("--temperature must be in [0, 100]")
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair()
    engines = {"plain": SpecEngine(target, None, tokenizer, screen_greedy=False),
               "plain_screened": SpecEngine(target, None, tokenizer, screen_greedy=True),
               "dflash": SpecEngine(target, drafter, tokenizer, screen_greedy=False, draft_policy=args.draft_policy),
               "dflash_screened": SpecEngine(target, drafter, tokenizer, screen_greedy=True,
                                             draft_policy=args.draft_policy)}
    text = [t for p in load_prompts(args.sets.split(",")[0], 64) for t in tokenizer.encode(p.text)]
    print("| rows x tokens | target forward, full read-out | screened | ratio |\n|---|---|---|---|")
    verify = []
    for width in (1, 16):  # a one-token step per row, a drafting cycle's verify
        for v in forward_costs(engines["dflash_screened"].fast, text, batches, width, temperature=args.temperature,
                               reps=args.forward_reps):
            verify.append(v)
            print(f"| {v['rows']} x {width} | {v['full_ms']:.2f} ms | {v['screened_ms']:.2f} ms | {v['ratio']:.2f} |",
                  flush=True)
    if args.forward_only:
        batches = []
    cells = []
    print("| set | batch | plain tok/s (full / screened) | DFlash tok/s (full / screened) | DFlash / plain, full "
          "read-out | DFlash / plain, screened | outputs equal |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.sets.split(","):
        prompts = [tokenizer.encode(p.text) for p in load_prompts(spec, args.num_prompts)]
        for batch in batches:
            for engine in engines.values():
                engine.warmup(batch)
            cell = {"set": spec, **measure(engines, prompts, batch, args.max_new_tokens, args.rounds,
                                           args.temperature)}
            cells.append(cell)
            print(f"| {spec} | {batch} | {cell['plain']['tok_s_cpu']:.0f} / {cell['plain_screened']['tok_s_cpu']:.0f} "
                  f"| {cell['dflash']['tok_s_cpu']:.0f} / {cell['dflash_screened']['tok_s_cpu']:.0f} "
                  f"| {cell['speedup_full_cpu']:.2f}x | {cell['speedup_screened_cpu']:.2f}x "
                  f"| {'yes' if cell['outputs_equal'] else 'NO'} |", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "verify_forward": verify, "cells": cells},
                                              indent=1))
    return 0 if all(c["outputs_equal"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
