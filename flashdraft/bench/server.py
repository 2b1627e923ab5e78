"""Benchmark any OpenAI-compatible server (`flashdraft serve`, vLLM, SGLang) over a concurrency sweep.

For each concurrency level the prompts are sent as streaming requests (httpx, asyncio; at most `concurrency` in
flight; all at once, a closed loop, or with `request_rate` arriving as a seeded Poisson process, the same arrival
times for every server), and per request the time to the first text chunk, the latency and the output tokens (the
final `usage` chunk, `stream_options.include_usage`; else the number of content chunks) are recorded. Throughput =
output tokens of the level / its wall time. Several servers (`name=URL`) are interleaved level by level; a server named
`ar` is the baseline of the speedups.

Acceptance comes from the server's Prometheus `/metrics`, read before and after each level: the vLLM counters
`spec_decode_num_drafts`, `spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`,
`spec_decode_num_accepted_tokens_per_pos{position}` (any `vllm:`-style prefix, `_total` suffix and extra labels
are accepted; label sets are summed), so tau = 1 + accepted / drafts over exactly the level's requests. Without
those counters, the mean of a per-response `flashdraft.tau` field (our server adds it) is used when present.
Where the server exports `process_cpu_seconds_total` (ours, vLLM's and SGLang's do, on Linux), a level also
reports the server's CPU seconds and output tokens per CPU-second, and `cpu_speedup` beside `speedup`: what a
token costs the server in work, which a busy machine moves far less than it moves wall time.

With greedy decoding, outputs are compared with the reference (the `ar` server at the first level, else the same
server at the first level): the same prompt must give the same text at every concurrency.

What this module does not know about: models (it only speaks HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time

from flashdraft.bench.datasets import Prompt
from flashdraft.bench.metrics import from_counters, percentile

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)(\s+\d+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_COUNTERS = {"spec_decode_num_drafts": "drafts", "spec_decode_num_draft_tokens": "draft_tokens",
             "spec_decode_num_accepted_tokens": "accepted", "spec_decode_num_accepted_tokens_per_pos": "per_pos",
             "spec_decode_num_one_token_steps": "one_token_steps", "spec_decode_num_lookup_steps": "lookup_steps",
             "spec_decode_num_lookup_accepted_tokens": "lookup_accepted", "process_cpu_seconds": "cpu_s",
             "prefix_cache_queries": "prefix_queries", "prefix_cache_hits": "prefix_hits"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(args: list[str], log, name: str = "flashdraft serve", cwd=None, timeout: float = 300,
                 cpus: set[int] | None = None):
    """`python -m flashdraft.cli serve --port <a free port> *args` in a subprocess writing to `log`, waited for until
    its /health answers; yields (base URL, process) and terminates it on exit. `cwd`: where it runs (`-m` puts the
    working directory first on sys.path, ahead of PYTHONPATH: run outside a checkout to pick the engine by it).
    `cpus`: the only CPUs the server and every thread it starts may run on (Linux)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "--port", str(port), *args]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, preexec_fn=pin)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: see {getattr(log, 'name', 'its log')}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout:.0f} s: see {getattr(log, 'name', 'its log')}")
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()


def parse_spec_metrics(text: str) -> dict | None:
    """The spec-decode counters (and the process's CPU seconds, the prefix cache's prompt tokens looked up and found)
    in a Prometheus exposition text, summed over label sets; None if absent."""
    out: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name = m.group(1).rsplit(":", 1)[-1]
        if name.endswith("_total"):
            name = name[: -len("_total")]
        key = _COUNTERS.get(name)
        if key is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if key == "per_pos":
            labels = dict(_LABEL.findall(m.group(2) or ""))
            if "position" not in labels:
                continue
            pos = int(labels["position"])
            out.setdefault("per_pos", {})
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
        else:
            out[key] = out.get(key, 0.0) + value
    return out or None


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    if not after:
        return None
    before = before or {}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0)
             for k in ("drafts", "draft_tokens", "accepted", "one_token_steps", "lookup_steps", "lookup_accepted")}
    if "cpu_s" in after:
        delta["cpu_s"] = after["cpu_s"] - before.get("cpu_s", 0.0)
    pa, pb = after.get("per_pos", {}), before.get("per_pos", {})
    delta["per_pos"] = {p: pa[p] - pb.get(p, 0.0) for p in pa}
    return delta


def parse_servers(specs: list[str]) -> list[tuple[str, str]]:
    """`URL` or `name=URL` -> (name, base url without a trailing /v1)."""
    out = []
    for i, s in enumerate(specs):
        name, _, url = s.partition("=") if "=" in s.split("://", 1)[0] else ("", "", s)
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        out.append((name or (f"server{i + 1}" if len(specs) > 1 else "server"), url))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must be unique: {names}")
    return out


class ServerClient:
    def __init__(self, name: str, base_url: str, model: str | None, api: str, max_tokens: int, temperature: float,
                 top_p: float, seed: int | None, ignore_eos: bool, timeout: float = 600.0, api_key: str | None = None):
        import httpx

        self.name, self.base, self.api = name, base_url, api
        self.model = model
        self.body = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stream": True,
                     "stream_options": {"include_usage": True}}
        if seed is not None and temperature > 0:
            self.body["seed"] = seed
        if ignore_eos:
            self.body["ignore_eos"] = True
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=self.base, timeout=timeout, headers=headers, limits=limits)

    async def close(self):
        await self.http.aclose()

    async def resolve_model(self) -> str:
        if self.model is None:
            r = await self.http.get("/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
            if not data:
                raise ValueError(f"{self.base}/v1/models lists no model; pass --model")
            self.model = data[0]["id"]
        return self.model

    async def metrics(self) -> dict | None:
        try:
            r = await self.http.get("/metrics")
        except Exception:
            return None
        return parse_spec_metrics(r.text) if r.status_code == 200 else None

    async def request(self, index: int, prompt: Prompt) -> dict:
        use_chat = self.api == "chat" or (self.api == "auto" and prompt.messages is not None)
        body = dict(self.body, model=self.model)
        if use_chat:
            path, body["messages"] = "/v1/chat/completions", prompt.as_messages()
        else:
            if prompt.text is None:
                raise ValueError("a chat prompt ('messages') needs --api chat or auto")
            path, body["prompt"] = "/v1/completions", prompt.text
        rec = {"index": index, "ttft_s": None, "latency_s": None, "tokens": 0, "text": "", "error": None}
        chunks, usage, tau = 0, None, None
        t0 = time.perf_counter()
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        raise RuntimeError(str(event["error"])[:200])
                    if event.get("usage"):
                        usage = event["usage"]
                    if isinstance(event.get("dflash"), dict) and event["dflash"].get("tau") is not None:
                        tau = event["dflash"]["tau"]
                    for choice in event.get("choices") or []:
                        piece = choice.get("text")
                        if piece is None:
                            piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if rec["ttft_s"] is None:
                                rec["ttft_s"] = time.perf_counter() - t0
                            rec["text"] += piece
                            chunks += 1
        except Exception as exc:  # one failed request must not sink the level
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["latency_s"] = time.perf_counter() - t0
        if rec["ttft_s"] is None:
            rec["ttft_s"] = rec["latency_s"]
        rec["tokens"] = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None \
            else chunks
        rec["token_count"] = "usage" if usage else "chunks"
        if tau is not None:
            rec["tau"] = tau
        return rec

    async def run_level(self, prompts: list[Prompt], concurrency: int, num_requests: int,
                        arrivals: list[float] | None = None) -> tuple[list[dict], float]:
        """Every request at once, at most `concurrency` in flight; or request i sent at `arrivals[i]` seconds from
        the level's start (still at most `concurrency` in flight)."""
        sem = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()

        async def one(i):
            if arrivals is not None:
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with sem:
                return await self.request(i, prompts[i % len(prompts)])

        recs = await asyncio.gather(*(one(i) for i in range(num_requests)))
        return list(recs), time.perf_counter() - t0


def poisson_arrivals(num_requests: int, rate: float | None, seed: int = 0) -> list[float] | None:
    """Arrival times (seconds from a level's start) of `num_requests` requests arriving as a Poisson process of
    `rate` requests per second, the first at 0 (None: no rate, every request at once). Seeded, so every server of
    a run sees the same arrivals."""
    if rate is None:
        return None
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def level_summary(concurrency: int, recs: list[dict], wall: float, delta: dict | None) -> dict:
    ok = [r for r in recs if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    out = {
        "concurrency": concurrency,
        "num_requests": len(recs),
        "errors": len(recs) - len(ok),
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "throughput_tok_s": round(tokens / wall, 3) if wall > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall, 4) if wall > 0 else 0.0,
        "ttft_ms": round(1000 * statistics.fmean(ttft), 3) if ttft else None,
        "ttft_ms_p50": round(1000 * percentile(ttft, 0.5), 3) if ttft else None,
        "ttft_ms_p99": round(1000 * percentile(ttft, 0.99), 3) if ttft else None,
        "tpot_ms": round(1000 * statistics.fmean(tpot), 3) if tpot else None,
        "latency_s": round(statistics.fmean(r["latency_s"] for r in ok), 4) if ok else None,
    }
    if delta is not None and delta.get("cpu_s", 0) > 0:
        out["server_cpu_s"] = round(delta["cpu_s"], 3)
        out["tok_per_cpu_s"] = round(tokens / delta["cpu_s"], 3)
    if delta is not None and (delta.get("drafts") or delta.get("one_token_steps") or delta.get("lookup_steps")):
        # of the rows' cycles, the share that drafted: whether the draft policy drafted at this load at all (lookup
        # steps are cycles the policy left without a draft)
        drafts, lookups = delta.get("drafts", 0), delta.get("lookup_steps", 0)
        out["drafting_share"] = round(drafts / (drafts + delta.get("one_token_steps", 0) + lookups), 4)
        if lookups:
            out["lookup_steps"], out["lookup_accepted"] = int(lookups), int(delta.get("lookup_accepted", 0))
    if delta is not None and delta.get("drafts"):
        out.update(from_counters(delta), acceptance_source="metrics")
        out["spec_counters"] = {k: v for k, v in delta.items() if k != "per_pos"} | {
            "per_pos": {str(k): v for k, v in sorted(delta["per_pos"].items())}}
    elif any("tau" in r for r in ok):
        taus = [r["tau"] for r in ok if "tau" in r]
        out.update(tau=round(statistics.fmean(taus), 4), acceptance_source="response")
    else:
        out.update(tau=None, acceptance_source=None)
    return out


async def _run(servers, prompts, concurrencies, num_requests, greedy, progress, task, request_rate=None,
               seed=0) -> dict:
    results = {}
    try:
        for c in servers:
            await c.resolve_model()
            await c.request(-1, prompts[0])  # warm-up, not recorded
            results[c.name] = {"url": c.base, "model": c.model, "levels": [], "outputs": {}}
        for li, conc in enumerate(concurrencies):
            n = num_requests or max(len(prompts), conc)
            order = servers[li % len(servers):] + servers[:li % len(servers)]
            for c in order:
                if progress is not None:
                    progress.update(task, description=f"{c.name} concurrency {conc}")
                before = await c.metrics()
                recs, wall = await c.run_level(prompts, conc, n, poisson_arrivals(n, request_rate, seed + li))
                after = await c.metrics()
                summary = level_summary(conc, recs, wall, counter_delta(before, after))
                summary["request_rate"] = request_rate
                summary["metrics_endpoint"] = after is not None
                summary["requests"] = recs
                results[c.name]["levels"].append(summary)
                if progress is not None:
                    progress.advance(task)
    finally:
        for c in servers:
            await c.close()
    _check_outputs(results, len(prompts), greedy)
    _speedups(results)
    return results


def _check_outputs(results: dict, num_prompts: int, greedy: bool) -> None:
    if not greedy:
        for srv in results.values():
            for lv in srv["levels"]:
                lv["mismatches"] = None
        return
    ref_name = "ar" if "ar" in results else None
    for name, srv in results.items():
        ref_srv = results[ref_name or name]
        if not ref_srv["levels"]:
            continue
        ref = {r["index"]: r["text"] for r in ref_srv["levels"][0]["requests"] if r["error"] is None
               and r["index"] < num_prompts}
        srv["reference"] = f"{ref_name or name} at concurrency {ref_srv['levels'][0]['concurrency']}"
        for lv in srv["levels"]:
            bad = sorted({r["index"] % num_prompts for r in lv["requests"] if r["error"] is None
                          and r["index"] % num_prompts in ref and r["text"] != ref[r["index"] % num_prompts]})
            lv["mismatches"] = len(bad)
            lv["mismatched_prompts"] = bad


def _speedups(results: dict) -> None:
    if "ar" not in results:
        return
    for key, speedup in (("throughput_tok_s", "speedup"), ("tok_per_cpu_s", "cpu_speedup")):
        base = {lv["concurrency"]: lv.get(key) for lv in results["ar"]["levels"]}
        for srv in results.values():
            for lv in srv["levels"]:
                b, value = base.get(lv["concurrency"]), lv.get(key)
                lv[speedup] = round(value / b, 3) if b and value is not None else None


def run_servers(server_specs: list[str], prompts: list[Prompt], concurrencies: list[int], *, model: str | None = None,
                api: str = "auto", max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                seed: int | None = 0, ignore_eos: bool = False, num_requests: int | None = None,
                api_key: str | None = None, progress=None, request_rate: float | None = None) -> dict:
    """Benchmark each server over the concurrency sweep; returns {"servers": {name: {...levels...}}}.
    `request_rate`: requests arrive as a Poisson process of that many per second (the same arrival times for every
    server), at most the level's concurrency in flight; None: all at once (a closed loop at the concurrency)."""
    if any(c < 1 for c in concurrencies):
        raise ValueError(f"concurrency levels must be >= 1, got {concurrencies}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    pairs = parse_servers(server_specs)
    task = progress.add_task("server", total=len(pairs) * len(concurrencies)) if progress is not None else None

    async def main():
        clients = [ServerClient(name, url, model, api, max_tokens, temperature, top_p, seed, ignore_eos,
                                api_key=api_key) for name, url in pairs]
        return await _run(clients, prompts, concurrencies, num_requests, temperature == 0, progress, task,
                          request_rate, seed or 0)

    return {"mode": "server", "servers": asyncio.run(main())}
