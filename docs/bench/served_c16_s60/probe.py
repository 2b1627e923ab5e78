"""One served cell, seen from both ends: per round, each server's wall time as the client measured it, its CPU
seconds (`/metrics`), and its own cycle trace over the same span (cycles, their summed ms, the time before the first
and after the last cycle, the gaps between cycles), the drafting server and plain decoding alternating.

    python docs/bench/served_c16_s60/probe.py [--rounds 4] [--concurrency 16] [--set default] [--num-prompts 64]

Written to tell a served cell's shortfall apart: work the drafting server does per token (CPU ratio, cycle ms)
against time neither server spends on the CPU (wall minus CPU: the client, the machine's other tenants).
What this script does not know about: how the servers decode (it reads their traces, it does not interpret them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

from serve_sweep import server  # noqa: E402

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.server import ServerClient  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--set", default="default", help="a `flashdraft bench` dataset (default: the held-out prompts)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    prompts = load_prompts(args.set, args.num_prompts)
    work = Path(tempfile.mkdtemp(prefix="served_probe_"))
    traces = {"dflash": work / "dflash.jsonl", "ar": work / "ar.jsonl"}

    def span(name, t0, t1):
        return [c for c in map(json.loads, traces[name].read_text().splitlines()) if t0 <= c["time"] <= t1 + 0.5]

    async def level(client):
        await client.request(-1, prompts[0])  # warm-up, as `flashdraft bench --server` sends
        before = await client.metrics()
        t0 = time.time()
        recs, _ = await client.run_level(prompts, args.concurrency, len(prompts))
        t1 = time.time()
        after = await client.metrics()
        return t0, t1, recs, after["cpu_s"] - before["cpu_s"]

    with contextlib.ExitStack() as stack:
        urls = {n: stack.enter_context(server(n, (["--no-draft"] if n == "ar" else []) +
                                              ["--cycle-trace", str(traces[n])], 1, args.concurrency, work))
                for n in traces}

        async def run():
            clients = {n: ServerClient(n, u, None, "auto", args.max_tokens, args.temperature, 1.0, 0, True)
                       for n, u in urls.items()}
            for c in clients.values():
                await c.resolve_model()
            tok_s, cpu = {n: [] for n in clients}, {n: [] for n in clients}
            for r in range(args.rounds):
                for n in (["ar", "dflash"] if r % 2 == 0 else ["dflash", "ar"]):
                    t0, t1, recs, cpu_s = await level(clients[n])
                    cycles = span(n, t0, t1)
                    tokens = sum(x["tokens"] for x in recs)
                    cycle_s = sum(c["ms"] for c in cycles) / 1000
                    first = cycles[0]["time"] - cycles[0]["ms"] / 1000 - t0
                    last = t1 - cycles[-1]["time"]
                    tok_s[n].append(tokens / (t1 - t0))
                    cpu[n].append(tokens / cpu_s)
                    print(f"round {r} {n:6s} wall {t1 - t0:5.2f} s  cpu {cpu_s:5.2f} s  {tokens / (t1 - t0):4.0f} tok/s  "
                          f"cycles {len(cycles)} ({cycle_s:.2f} s)  before the first {1000 * first:.0f} ms  after "
                          f"the last {1000 * last:.0f} ms  between {t1 - t0 - cycle_s - first - last:.2f} s  "
                          f"latency median {statistics.median(x['latency_s'] for x in recs):.2f} s", flush=True)
            print("DFlash / plain, wall by round:", [round(a / b, 3) for a, b in zip(tok_s["dflash"], tok_s["ar"])])
            print("DFlash / plain, tokens per CPU-second by round:",
                  [round(a / b, 3) for a, b in zip(cpu["dflash"], cpu["ar"])])
            print(f"traces kept in {work}")

        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
