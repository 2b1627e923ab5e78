"""A minimal load generator for a running `flashdraft serve`: throughput and latency versus concurrency.

    python -m flashdraft.serve.loadtest --url http://127.0.0.1:8000 --concurrency 1,4,16,32 --max-tokens 64

For each concurrency level C it keeps C streaming /v1/completions requests in flight (greedy, `ignore_eos` so every
request produces exactly --max-tokens tokens unless --allow-eos) until --requests have finished, and reports
requests/s, output tokens/s, mean time to first token, p50/p95 latency and the mean acceptance length (tau) the
server reported. Standard library only (threads + urllib), so it runs wherever Python does.

What this module does not know about: the engine or the server's internals; it is an HTTP client. The full
benchmark harness (datasets, plots, baselines) is `flashdraft bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
    "def quicksort(items):\n", "def read_json(path):\n", "from dataclasses import dataclass\n\n\n@dataclass\nclass",
    "def is_prime(n: int) -> bool:\n", "def merge_sorted(a, b):\n", "def binary_search(xs, target):\n",
    "def word_count(text):\n", "import re\n\n\ndef slugify(s):\n", "def flatten(nested):\n",
    "class LRUCache:\n", "def transpose(matrix):\n", "def parse_args():\n", "def gcd(a, b):\n",
]


def _request(url: str, body: dict, headers: dict) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json",
                                                                           **headers})
    start = time.perf_counter()
    ttft, usage, stats = None, None, None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("dflash"):
                stats = chunk["dflash"]
    latency = time.perf_counter() - start
    return {"latency": latency, "ttft": ttft if ttft is not None else latency,
            "tokens": usage["completion_tokens"] if usage else 0, "tau": stats["tau"] if stats else None}


def run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int, ignore_eos: bool,
              headers: dict) -> dict:
    bodies = [{"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
              for i in range(n_requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda b: _request(url, b, headers), bodies))
    wall = time.perf_counter() - start
    lat = sorted(r["latency"] for r in results)
    taus = [r["tau"] for r in results if r["tau"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": n_requests, "wall_s": round(wall, 3),
            "requests_per_s": round(n_requests / wall, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 2),
            "mean_ttft_ms": round(1000 * statistics.mean(r["ttft"] for r in results), 1),
            "p50_latency_s": round(lat[len(lat) // 2], 3), "p95_latency_s": round(lat[int(0.95 * (len(lat) - 1))], 3),
            "mean_tau": round(statistics.mean(taus), 3) if taus else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.serve.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: max(16, 2 x level))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--allow-eos", action="store_true", help="let requests stop at EOS (default: fixed length)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    model = args.model
    if model is None:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    if args.warmup:
        run_level(url, model, 1, args.warmup, min(8, args.max_tokens), not args.allow_eos, headers)
    rows = []
    print(f"{'conc':>4} {'reqs':>5} {'wall s':>7} {'req/s':>7} {'out tok/s':>10} {'TTFT ms':>8} {'p50 s':>7} "
          f"{'p95 s':>7} {'tau':>6}")
    for level in (int(x) for x in args.concurrency.split(",")):
        n = args.requests or max(16, 2 * level)
        row = run_level(url, model, level, n, args.max_tokens, not args.allow_eos, headers)
        rows.append(row)
        print(f"{level:>4} {n:>5} {row['wall_s']:>7.2f} {row['requests_per_s']:>7.2f} "
              f"{row['output_tokens_per_s']:>10.1f} {row['mean_ttft_ms']:>8.1f} {row['p50_latency_s']:>7.2f} "
              f"{row['p95_latency_s']:>7.2f} {row['mean_tau'] if row['mean_tau'] is not None else '-':>6}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": url, "model": model, "max_tokens": args.max_tokens, "levels": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
