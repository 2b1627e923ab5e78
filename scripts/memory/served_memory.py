"""Memory of a running `flashdraft serve` under one long request among short ones, end to end over HTTP.

    python scripts/memory/served_memory.py [--long 1300] [--short 15] [--max-tokens 64] [--kv-cache-memory 1]
    PYTHONPATH=/path/to/other/checkout python scripts/memory/served_memory.py ...   # another engine's server

Starts the server on the shipped pair (one thread, --max-batch-size 16), sends one warm-up request, then sends at
once one request whose prompt is --long tokens of Python source (transformers' own) and --short requests of 64
tokens, each with --max-tokens, greedy. While they run it polls the server's /metrics (`kv_cache_reserved_positions`:
what the batch takes by the scheduler's rule) and the server process's resident memory (/proc/PID/status); at the
end it reads the process's peak (VmHWM). Prints one JSON line: peak reserved positions, RSS after the warm-up,
peak RSS during the requests, and the tokens each request held.

What this script does not know about: which engine it measures (PYTHONPATH picks the package the server imports).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx

from flashdraft.bench.server import local_server

MiB = 2**20


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reserved_positions(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("flashdraft_kv_cache_reserved_positions") or line.startswith("kv_cache_reserved_positions"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def source_prompts(long: int, short: int, count: int) -> tuple[str, list[str]]:
    """One prompt of `long` tokens and `count` of `short`, cut from transformers' source at token boundaries."""
    import transformers.modeling_utils as source
    from transformers import AutoTokenizer

    from flashdraft.loading import DEFAULT_TARGET

    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    ids = tok(Path(source.__file__).read_text(), add_special_tokens=False)["input_ids"]
    return tok.decode(ids[:long]), [tok.decode(ids[long + i * short: long + (i + 1) * short]) for i in range(count)]


@contextlib.contextmanager
def server(extra: list[str]):
    """The server on the shipped pair, run from this script's folder (so PYTHONPATH picks the engine); yields (URL,
    pid)."""
    args = ["--threads", "1", "--max-batch-size", "16", "--log-level", "warning", *extra]
    with tempfile.TemporaryFile("w+") as log, local_server(args, log, cwd=Path(__file__).parent) as (url, proc):
        yield url, proc.pid


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long", type=int, default=1300, help="prompt tokens of the long request")
    p.add_argument("--short", type=int, default=15, help="how many 64-token requests run beside it")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory", help="the server's --kv-cache-memory (default: none)")
    args = p.parse_args(argv)
    long_prompt, short_prompts = source_prompts(args.long, 64, args.short)
    extra = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
    with server(extra) as (url, pid):
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]

        def complete(prompt: str) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            resp = httpx.post(url + "/v1/completions", json=body, timeout=600)
            resp.raise_for_status()
            return resp.json()["usage"]

        complete(short_prompts[0])  # warm-up: the engine's lazily built state
        base = status_kib(pid, "VmRSS")
        done, peaks = threading.Event(), {"reserved": 0.0, "rss": base}

        def poll():
            while not done.is_set():
                with contextlib.suppress(httpx.HTTPError, KeyError, FileNotFoundError):
                    peaks["reserved"] = max(peaks["reserved"], reserved_positions(url))
                    peaks["rss"] = max(peaks["rss"], status_kib(pid, "VmRSS"))
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        results: list = [None] * (1 + len(short_prompts))
        workers = [threading.Thread(target=lambda i=i, t=t: results.__setitem__(i, complete(t)))
                   for i, t in enumerate([long_prompt, *short_prompts])]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        done.set()
        poller.join()
        out = {"long": args.long, "short": args.short, "max_tokens": args.max_tokens,
               "kv_cache_memory": args.kv_cache_memory, "peak_reserved_positions": peaks["reserved"],
               "rss_after_warmup_mib": round(base / 1024, 1), "peak_rss_mib": round(peaks["rss"] / 1024, 1),
               "vm_hwm_mib": round(status_kib(pid, "VmHWM") / 1024, 1),
               "tokens_held": [u["prompt_tokens"] + u["completion_tokens"] for u in results]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
