"""What asking for log-probabilities costs: the shipped pair, one engine, the same requests with
`SamplingParams.logprobs` = None (not asked), 0 (the chosen token's) and k (with k alternatives), in alternating order.

    python scripts/speed/logprobs_cost.py [--batch 1,16] [--num-prompts 32] [--max-tokens 64] [--rounds 3]
        [--temperature 0] [--top 5] [--threads 1]

Per batch size, every round runs the held-out prompts in batches of that many rows through each setting (the order
rotating by round) and prints tokens per second of each, its ratio to not asking, and whether every setting
produced the same tokens (asking must change none; exit 1 if one did not). Rows that ask keep the full fp32 read-out
(`_chooses`), so on a CPU with the screened greedy read-out the greedy cost includes losing it.

What this script does not know about: HTTP (the server formats the same figures), plain decoding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402

from flashdraft.engine import SamplingParams  # noqa: E402


def run(engine, prompts, batch: int, params: SamplingParams) -> tuple[float, int, list]:
    """(seconds, tokens, token ids per prompt) of the prompts in batches of `batch` rows."""
    start, outputs = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outputs += [r.token_ids for r in engine.generate(prompts[i:i + batch], params)]
    return time.perf_counter() - start, sum(map(len, outputs)), outputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top", type=int, default=5, help="alternatives per token of the third setting")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    target, tokenizer, drafter, prompts = engine_concurrency.shipped_pair("default", args.num_prompts, args.threads)
    engine = engine_concurrency.build_engine(target, tokenizer, drafter, "adaptive")
    settings = [None, 0, args.top]
    names = {None: "not asked", 0: "logprobs=0", args.top: f"logprobs={args.top}"}
    print(f"temperature {args.temperature}, {len(prompts)} held-out prompts x {args.max_tokens} tokens, "
          f"{args.rounds} rounds, screened read-out: {engine.screens_readout}")
    all_same = True
    print("| rows | setting | tok/s | / not asked | same tokens |")
    print("|---|---|---|---|---|")
    for batch in map(int, args.batch.split(",")):
        engine_concurrency.warm(engine, prompts, batch, args.temperature)
        seconds, tokens, outputs = ({s: 0.0 for s in settings}, {s: 0 for s in settings}, {})
        for r in range(args.rounds):
            for s in settings[r % 3:] + settings[:r % 3]:
                params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, seed=0,
                                        logprobs=s)
                took, n, out = run(engine, prompts, batch, params)
                seconds[s] += took
                tokens[s] += n
                outputs.setdefault(s, out)
        base = tokens[None] / seconds[None]
        for s in settings:
            rate = tokens[s] / seconds[s]
            same = outputs[s] == outputs[None]
            all_same &= same
            print(f"| {batch} | {names[s]} | {rate:.1f} | {rate / base:.3f} | {same} |")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
