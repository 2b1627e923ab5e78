"""Conversations through the engine with and without the prefix cache: each conversation's next turn is its earlier
prompts and answers then a new message, so with the cache (answers' pages go in as decoding fills them) a turn
computes only its new message. Shipped pair, in process, greedy; the two engines alternate conversation by
conversation. Reported per turn: time to first token (mean over conversations) of each engine, and the share of
the turn's prompt tokens the cache gave; the answers must be the same.

    python scripts/speed/prefix_cache_turns.py --conversations 8 --turns 4 --max-tokens 64

What this script does not know about: HTTP (the served figures are `prefix_cache.py`'s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from flashdraft.bench.datasets import load_prompts
from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.loading import load_pair


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default="runs/prefix_cache_turns.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(None, None, "cpu", None, None)
    messages = [q.encode(tokenizer, False) for q in load_prompts("default", args.conversations * args.turns)]
    engines = {"cached": SpecEngine(target, drafter, tokenizer, prefix_cache_tokens=1 << 16),
               "uncached": SpecEngine(target, drafter, tokenizer)}
    params = SamplingParams(max_new_tokens=args.max_tokens)
    ttft = {name: [[] for _ in range(args.turns)] for name in engines}
    share = [[] for _ in range(args.turns)]
    same = 0
    for c in range(args.conversations):
        answers = {}
        for k, name in enumerate(engines if c % 2 == 0 else list(engines)[::-1]):
            prompt = []
            for t in range(args.turns):
                prompt = prompt + messages[c * args.turns + t]
                result = engines[name].generate([prompt], params)[0]
                ttft[name][t].append(result.stats.time_to_first_token)
                if name == "cached":
                    share[t].append(result.stats.cached_tokens / len(prompt))
                answers.setdefault(name, []).append(result.token_ids)
                prompt = prompt + result.token_ids
        same += answers["cached"] == answers["uncached"]
    rows = []
    for t in range(args.turns):
        cached, uncached = (1000 * statistics.fmean(ttft[n][t]) for n in ("cached", "uncached"))
        rows.append({"turn": t + 1, "ttft_ms_cached": round(cached, 1), "ttft_ms_uncached": round(uncached, 1),
                     "ttft_ratio": round(uncached / cached, 2), "cached_share": round(statistics.fmean(share[t]), 3)})
        print(f"turn {t + 1}: time to first token {cached:.1f} / {uncached:.1f} ms ({uncached / cached:.2f}x), "
              f"{100 * rows[-1]['cached_share']:.0f} % of the prompt cached")
    print(f"same answers in {same}/{args.conversations} conversations")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"argv": sys.argv, "turns": rows, "same": same,
                                             "conversations": args.conversations}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
