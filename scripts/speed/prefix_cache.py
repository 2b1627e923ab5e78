"""What automatic prefix caching gives a server whose requests share a long start (a system prompt, a document, a
file of code): two `flashdraft serve` processes on the shipped pair, the default (prefix cache on) and
`--no-enable-prefix-caching`, the same requests through `flashdraft bench --server`'s client, interleaved round by
round at each concurrency.

Each prompt is one shared context of `--context-tokens` tokens (code cut from an installed package's source: no
prompt the pair was tuned for), a comment line naming the request (so nothing after the context repeats: every
request of every round is new past it), then one of the shipped pair's held-out prompts. Reported per concurrency:
output tokens per second and time to first token (mean, median) of each server, their ratios, the share of prompt
tokens the cache gave (its /metrics counters), and whether the greedy texts of the two servers are the same. (The
client's warm-up request before each round is the round's first prompt, which the cached server then finds whole:
one request in `--num-prompts` is a repeat.)

    python scripts/speed/prefix_cache.py                                   # contexts of 1,024 tokens, 1/4/16 requests
    python scripts/speed/prefix_cache.py --context-tokens 256,1024 --concurrency 1,16 --temperature 1

Writes runs/prefix_cache/results.json and table.md. What this script does not know about: how the servers cache
(it starts them and speaks HTTP).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import httpx

from flashdraft.bench.datasets import Prompt, load_prompts, source_contexts
from flashdraft.bench.server import parse_spec_metrics, run_servers
from flashdraft.loading import DEFAULT_TARGET, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_sweep import server  # noqa: E402

SERVERS = {"cached": [], "uncached": ["--no-enable-prefix-caching"]}


def shared_context(tokenizer, tokens: int) -> str:
    return tokenizer.decode(source_contexts(tokenizer, 1, tokens, end_at_line_start=True)[0])


def requests(context: str, held_out: list[Prompt], tag: str) -> list[Prompt]:
    """The context, a line naming each request, then each held-out prompt."""
    return [Prompt(text=f"{context}# request {tag}.{i}\n{p.text}") for i, p in enumerate(held_out)]


def prefix_counters(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) so far, from the server's /metrics."""
    counters = parse_spec_metrics(httpx.get(f"{url}/metrics", timeout=30).text) or {}
    return counters.get("prefix_queries", 0.0), counters.get("prefix_hits", 0.0)


def cell(urls: dict, context: str, held_out: list[Prompt], concurrency: int, temperature: float, max_tokens: int,
         rounds: int) -> dict:
    """Both servers at one concurrency, `rounds` rounds in alternating order, each round's requests new."""
    levels = {name: [] for name in urls}
    texts = {name: {} for name in urls}
    before = {name: prefix_counters(url) for name, url in urls.items()}
    for r in range(rounds):
        order = list(urls.items()) if r % 2 == 0 else list(urls.items())[::-1]
        prompts = requests(context, held_out, f"{concurrency}.{r}")
        res = run_servers([f"{n}={u}" for n, u in order], prompts, [concurrency], max_tokens=max_tokens,
                          temperature=temperature, seed=0, ignore_eos=True, num_requests=len(prompts))["servers"]
        for name, srv in res.items():
            level = srv["levels"][0]
            if level["errors"]:
                raise RuntimeError(f"{name}: {level['errors']} failed requests at concurrency {concurrency}")
            levels[name].append(level)
            texts[name].update({(r, rec["index"]): rec["text"] for rec in level["requests"]})
    after = {name: prefix_counters(url) for name, url in urls.items()}
    out = {"concurrency": concurrency, "temperature": temperature}
    for name, lv in levels.items():
        ttft = [rec["ttft_s"] for level in lv for rec in level["requests"]]
        out[name] = {"tok_s": round(sum(x["output_tokens"] for x in lv) / sum(x["wall_s"] for x in lv), 1),
                     "ttft_ms": round(1000 * statistics.fmean(ttft), 1),
                     "ttft_ms_p50": round(1000 * statistics.median(ttft), 1),
                     "round_tok_s": [round(x["throughput_tok_s"], 1) for x in lv]}
        queries, hits = (a - b for a, b in zip(after[name], before[name]))
        out[name]["cached_share"] = round(hits / queries, 3) if queries else 0.0
    out["throughput_ratio"] = round(out["cached"]["tok_s"] / out["uncached"]["tok_s"], 3)
    out["ttft_ratio"] = round(out["uncached"]["ttft_ms"] / out["cached"]["ttft_ms"], 2)
    out["same_texts"] = None if temperature else sum(texts["cached"][i] == texts["uncached"].get(i)
                                                     for i in texts["cached"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context-tokens", default="1024", help="shared context lengths, comma-separated")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=16, help="requests per round (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--output-dir", default="runs/prefix_cache")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    cells = []
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(server(name, extra, args.threads, max(concurrencies), out))
                for name, extra in SERVERS.items()}
        for length in (int(n) for n in args.context_tokens.split(",")):
            context = shared_context(tokenizer, length)
            held_out = load_prompts("default", max(args.num_prompts, *concurrencies))
            for c in concurrencies:
                row = {"context_tokens": length, **cell(urls, context, held_out, c, args.temperature,
                                                        args.max_tokens, args.rounds)}
                cells.append(row)
                print(f"context {length:5d} conc {c:3d}: throughput {row['throughput_ratio']:.2f}x "
                      f"({row['cached']['tok_s']:.0f} / {row['uncached']['tok_s']:.0f} tok/s), time to first "
                      f"token {row['cached']['ttft_ms']:.0f} / {row['uncached']['ttft_ms']:.0f} ms "
                      f"({row['ttft_ratio']:.1f}x), cached {100 * row['cached']['cached_share']:.0f} % of prompt "
                      f"tokens, same texts {row['same_texts']}/{args.rounds * len(held_out)}", flush=True)
                (out / "results.json").write_text(json.dumps({"argv": sys.argv, "cells": cells}, indent=1))
    lines = ["| context tokens | requests | tok/s cached / uncached | ratio | TTFT ms cached / uncached (p50) | "
             "TTFT ratio | prompt tokens cached | same greedy texts |", "|---|---|---|---|---|---|---|---|"]
    for row in cells:
        cached, uncached = row["cached"], row["uncached"]
        lines.append(f"| {row['context_tokens']} | {row['concurrency']} | {cached['tok_s']:.0f} / "
                     f"{uncached['tok_s']:.0f} | {row['throughput_ratio']:.2f}x | {cached['ttft_ms']:.0f} / "
                     f"{uncached['ttft_ms']:.0f} ({cached['ttft_ms_p50']:.0f} / {uncached['ttft_ms_p50']:.0f}) | "
                     f"{row['ttft_ratio']:.1f}x | {100 * cached['cached_share']:.0f} % | "
                     f"{'' if row['same_texts'] is None else row['same_texts']} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
