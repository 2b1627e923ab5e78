"""`flashdraft serve` under abuse (issue 22): each test reproduces one finding against a live server (uvicorn in a
thread on a loopback port, the tiny pair of test_serve.py) and checks the fix.

1. size and time: a huge prompt neither stalls running streams nor /health (parsing and tokenizing run off the event
   loop, and a prompt too long to fit is refused by its byte count before tokenizing); bodies over the limit get 413,
   bodies that do not arrive in time 408, and held-open half-sent bodies are neither kept forever nor logged;
3. a lone UTF-16 surrogate anywhere (prompt, model name, keys, stop strings, messages) is a 400, not a 500;
6. shutdown: every stream still running when the drain ends gets an error event and [DONE], and so does one that
   uvicorn itself cancels; no tracebacks;
7. NaN / Infinity / out-of-range numbers and seeds get a correct message; long client strings are clipped in error
   messages; --port, --api-key and the timeouts are checked before anything loads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from test_serve import MAX_LEN, MODEL, Live, make_engine, pair, slow  # noqa: E402,F401  (pair: the fixture)

from flashdraft.serve.app import ServeConfig, create_app  # noqa: E402

C, CH = "/v1/completions", "/v1/chat/completions"


class Records(logging.Handler):
    """Every record of the server's loggers (uvicorn's and ours), to assert that nothing was logged as a crash."""

    NAMES = ("uvicorn.error", "uvicorn", "flashdraft.serve")

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)

    def crashes(self) -> list[str]:
        """Tracebacks, "Exception in ASGI application", and our own errors (uvicorn's one line saying that it
        cancels tasks past its graceful timeout is not a crash; tests that must not see it check `cancels`)."""
        out = []
        for r in self.records:
            text = r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
            if r.exc_info or any(w in text for w in ("Traceback", "CancelledError", "Exception in ASGI")) or (
                    r.name.startswith("flashdraft") and r.levelno >= logging.ERROR):
                out.append(text[:300])
        return out

    def cancels(self) -> list[str]:
        return [r.getMessage() for r in self.records if "timeout graceful shutdown exceeded" in r.getMessage()]


class Served:
    """The app served as `flashdraft serve` serves it (`cli.uvicorn_server`: drain on shutdown) in a background
    thread on a free loopback port."""

    def __init__(self, app):
        from flashdraft.serve.cli import uvicorn_server

        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn_server(app, app.state.server.config.drain_timeout, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True  # what uvicorn's SIGINT / SIGTERM handler does
        self.thread.join(timeout=60)

    def metric(self, name: str, **labels) -> float:
        return Live.metric(self, name, **labels)


def serve(pair, engine=None, **config) -> Served:
    config = {"model_name": MODEL, "max_model_len": MAX_LEN, **config}
    return Served(create_app(engine or make_engine(pair), ServeConfig(**config)))


def raw_request(url: str, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send `head` (request line + headers, without the blank line) and `body` on a raw socket; the response's
    status, headers and body (read until the server closes or Content-Length is complete)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before a response: {data!r}"
            data += chunk
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(headers.get("content-length", "-1"))
        while length < 0 or len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(lines[0].split()[1]), headers, rest


def post_head(path: str, length: int, extra: str = "") -> str:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {length}"
            + extra)


# ---- finding 1: a huge prompt, oversized and half-sent bodies ------------------------------------------------------


async def _watch_stream(http, url, body, log):
    """Run one stream, appending the arrival time of every SSE line to `log`."""
    async with http.stream("POST", f"{url}{C}", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                log.append(time.perf_counter())


async def _poll_health(http, url, stop: asyncio.Event, latencies):
    while not stop.is_set():
        start = time.perf_counter()
        r = await http.get(f"{url}/health")
        assert r.status_code == 200
        latencies.append((start, time.perf_counter() - start))
        await asyncio.sleep(0.05)


def _max_gap(times: list[float], start: float, end: float) -> float:
    """The longest wait for a next token between start and end."""
    inside = [start] + [t for t in times if start < t < end] + [min(t for t in times if t >= end)]
    return max(b - a for a, b in zip(inside, inside[1:]))


def test_huge_prompt_does_not_stall_streams_or_health(pair):
    """The attack: 8 streams running, then one 10 MB prompt (refused by its size in bytes, before tokenizing) and
    one 1.5 MB prompt that is tokenized (the byte check lifted): neither may delay a stream's next token or /health
    by more than a second."""
    s = serve(pair, slow(make_engine(pair, drafter=False), 0.05), max_body_bytes=16 << 20)
    huge = json.dumps({"model": MODEL, "prompt": "hello world " * (10_000_000 // 12), "max_tokens": 4}).encode()
    big = json.dumps({"model": MODEL, "prompt": "def f(x): return x + 1\n" * (1_500_000 // 23),
                      "max_tokens": 4}).encode()
    stream_body = {"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN - 4, "ignore_eos": True, "temperature": 0,
                   "stream": True}  # >= 19 s of tokens, 50 ms apart: they outlast the attack
    report = {}

    async def main():
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            logs = [[] for _ in range(8)]
            streams = [asyncio.ensure_future(_watch_stream(http, s.url, stream_body, log)) for log in logs]
            while sum(len(log) >= 3 for log in logs) < 8:  # every stream is producing tokens
                await asyncio.sleep(0.02)
            stop, latencies = asyncio.Event(), []
            poller = asyncio.ensure_future(_poll_health(http, s.url, stop, latencies))
            start = time.perf_counter()
            r1 = await http.post(f"{s.url}{C}", content=huge, headers={"content-type": "application/json"})
            t1 = time.perf_counter()
            s.app.state.server.max_prompt_bytes = 1 << 30  # let the next prompt through to the tokenizer
            r2 = await http.post(f"{s.url}{C}", content=big, headers={"content-type": "application/json"})
            end = time.perf_counter()
            stop.set()
            await poller
            report.update(huge=(r1.status_code, r1.json()["error"]["message"], t1 - start),
                          big=(r2.status_code, r2.json()["error"]["message"], end - t1))
            await asyncio.sleep(1.0)  # the tokens after the attack (a gap that straddles its end counts too)
            assert all(max(log) > end for log in logs), f"a stream ended before the attack did ({end - start:.1f} s)"
            gaps = [_max_gap(log, start, end) for log in logs]
            for task in streams:  # the streams have served their purpose
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return gaps, [lat for t, lat in latencies if start <= t <= end]

    try:
        gaps, health = asyncio.run(main())
    finally:
        s.stop()
    print(f"10 MB prompt: {report['huge'][0]} in {report['huge'][2]:.2f}s; 1.5 MB prompt tokenized: "
          f"{report['big'][0]} in {report['big'][2]:.2f}s; max token gap {max(gaps):.3f}s; /health max "
          f"{max(health):.3f}s over {len(health)} polls")
    assert report["huge"][0] == 400 and "refused before tokenizing" in report["huge"][1]
    assert report["big"][0] == 400 and "maximum context length" in report["big"][1]
    assert max(gaps) < 1.0, gaps
    assert len(health) >= 3 and max(health) < 1.0, health


def test_body_size_limit_and_body_timeout(pair):
    s = serve(pair, max_body_bytes=16 * 1024, body_timeout=1.0)
    with Records() as records:
        try:
            # a declared length over the limit: 413 before a byte of the body is read, and the connection closes
            status, headers, body = raw_request(s.url, post_head(C, 10_000_000))
            assert status == 413 and headers.get("connection") == "close"
            err = json.loads(body)["error"]
            assert "larger than the server's limit of 16384 bytes" in err["message"] and err["code"] == \
                "request_too_large"
            # a declared length up to 4x the limit is read and dropped first: a client that sends its whole body
            # before reading (most do) gets the 413, not a reset connection
            resp = httpx.post(f"{s.url}{C}", content=b"x" * 60_000, timeout=10)
            assert resp.status_code == 413 and "--max-body-bytes" in resp.json()["error"]["message"]
            # a chunked body (no declared length) is counted as it arrives
            chunk = b'{"model": "tiny", "prompt": "' + b"a" * 20_000 + b'"}'
            head = f"POST {C} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
            status, _, body = raw_request(s.url, head, f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
            assert status == 413 and "limit" in json.loads(body)["error"]["message"]
            # half-sent bodies: every one is answered 408 after body_timeout, while /health stays instant
            socks = []
            start = time.perf_counter()
            for _ in range(20):
                sock = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])), timeout=10)
                sock.sendall(post_head(C, 1000).encode() + b"\r\n\r\n" + b'{"model": "ti')
                socks.append(sock)
            t = time.perf_counter()
            assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200
            assert time.perf_counter() - t < 1.0
            for sock in socks:
                data = b""
                while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                sock.close()
                assert data.startswith(b"HTTP/1.1 408"), data[:200]
                assert b"did not arrive within 1 s" in data
            elapsed = time.perf_counter() - start
            assert 0.9 < elapsed < 5.0, elapsed
            # the server is intact
            ok = httpx.post(f"{s.url}{C}", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
            assert ok.status_code == 200
            assert s.metric("requests_rejected_total", reason="body_timeout") == 20
            assert s.metric("requests_rejected_total", reason="body_too_large") == 3
            # a half-sent body at shutdown is answered 503 at once (it does not hold the shutdown up)
            late = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            late.sendall(post_head(C, 1000).encode() + b"\r\n\r\n{")
            time.sleep(0.2)
            start = time.perf_counter()
        finally:
            s.stop()
        stopped = time.perf_counter() - start
        answer = late.recv(65536)
        late.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"shutting down" in answer, answer[:300]
        assert not s.thread.is_alive() and stopped < 3.0, stopped
        assert records.crashes() == [] and records.cancels() == []


# ---- finding 3: lone surrogates ----------------------------------------------------------------------------------

SURROGATES = [
    ("prompt", C, b'{"model": "tiny", "prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt"),
    ("model name", C, b'{"model": "\\udc00", "prompt": "hi", "max_tokens": 2}', "model"),
    ("stop string", C, b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop[0]"),
    ("object key", C, b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}', None),
    ("user", C, b'{"model": "tiny", "prompt": "hi", "user": "\\udfff"}', "user"),
    ("chat content", CH, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("content part", CH, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                         b'"text": "a\\ud800"}]}]}', "messages[0].content[0].text"),
]


@pytest.fixture(scope="module")
def server(pair):
    s = serve(pair)
    yield s
    s.stop()


@pytest.mark.parametrize("name,path,body,param", SURROGATES, ids=[x[0] for x in SURROGATES])
def test_lone_surrogate_is_a_400(server, name, path, body, param):
    with Records() as records:
        resp = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=30)
    assert resp.status_code == 400, (name, resp.text)
    err = resp.json()["error"]
    assert "not valid Unicode" in err["message"] and "surrogate" in err["message"], err
    assert err["param"] == param
    assert records.crashes() == []


# ---- finding 7: numbers, long names, flags -------------------------------------------------------------------------

NUMBERS = [
    # (body, status, words in the message)
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "'temperature' must be a finite number, got NaN"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', 400, "'temperature' must be a finite number"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}', 400, "'temperature' must be a finite number"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', 400, "'top_p' must be a finite number"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', 400, "'top_p' must be a finite number"),
    (b'{"model": "tiny", "prompt": "hi", "presence_penalty": NaN}', 400, "'presence_penalty' must be a finite"),
    (b'{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616}', 400, "'seed'"),
    (b'{"model": "tiny", "prompt": "hi", "seed": 9223372036854775808}', 400, "'seed'"),
    (b'{"model": "tiny", "prompt": "hi", "top_k": 100000000000000000000}', 400, "'top_k'"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 100000000000000000000}', 400, "maximum context length"),
    (b'{"model": "tiny", "prompt": [1, 1e400]}', 400, "prompt"),
]


@pytest.mark.parametrize("body,status,words", NUMBERS, ids=[b[30:70].decode() for b, _, _ in NUMBERS])
def test_non_finite_and_out_of_range_numbers(server, body, status, words):
    resp = httpx.post(f"{server.url}{C}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    assert words in resp.json()["error"]["message"], resp.json()


def test_in_range_extremes_are_served(server):
    """The largest seed and a top_k beyond the vocabulary (no filtering) are valid requests, not 500s."""
    for extra in ({"seed": 2**63 - 1, "temperature": 0.7}, {"seed": 0}, {"top_k": 2**31 - 1, "temperature": 1.0},
                  {"temperature": 2.0, "top_p": 1e-9}):
        resp = httpx.post(f"{server.url}{C}", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, **extra},
                          timeout=30)
        assert resp.status_code == 200, (extra, resp.text)


def test_long_client_strings_are_clipped_in_errors(server):
    name = "m" * 1_000_000
    resp = httpx.post(f"{server.url}{C}", json={"model": name, "prompt": "hi"}, timeout=30)
    assert resp.status_code == 404 and len(resp.content) < 600, len(resp.content)
    assert "does not exist" in resp.json()["error"]["message"] and "(1000000 characters)" in resp.text
    resp = httpx.get(f"{server.url}/v1/models/{'n' * 30_000}", timeout=30)
    assert resp.status_code == 404 and len(resp.content) < 600
    resp = httpx.post(f"{server.url}{C}", json={"model": MODEL, "prompt": "hi", "k" * 100_000: 1}, timeout=30)
    assert resp.status_code == 400 and len(resp.content) < 600 and "Unrecognized request argument" in resp.text
    resp = httpx.post(f"{server.url}/{'p' * 20_000}", json={}, timeout=30)
    assert resp.status_code == 404 and len(resp.content) < 600
    resp = httpx.delete(f"{server.url}{C}", timeout=30)
    assert resp.status_code == 405 and resp.headers.get("allow") == "POST"


def test_serve_flags_are_checked_before_loading(monkeypatch):
    import argparse

    from flashdraft.serve import cli

    def no_loading(args):
        raise RuntimeError("the engine would load: the flag was accepted")

    monkeypatch.setattr(cli, "build_engine", no_loading)
    monkeypatch.delenv("FLASHDRAFT_API_KEY", raising=False)

    def parse(*argv):
        parser = argparse.ArgumentParser(prog="flashdraft")
        cli.add_serve_parser(parser.add_subparsers(dest="command"))
        return parser.parse_args(["serve", *argv])

    for bad in (["--port", "70000"], ["--port", "0"], ["--port", "-1"], ["--drain-timeout", "nan"],
                ["--drain-timeout", "inf"], ["--drain-timeout", "-1"], ["--body-timeout", "0"],
                ["--max-body-bytes", "10"]):
        with pytest.raises(SystemExit):
            parse(*bad)
    assert parse("--port", "65535").port == 65535
    with pytest.raises(ValueError, match="--api-key .*is empty"):
        cli.run_serve(parse("--api-key", ""))
    with pytest.raises(ValueError, match="--api-key .*is empty"):
        cli.run_serve(parse("--api-key", "   "))
    monkeypatch.setenv("FLASHDRAFT_API_KEY", "")
    with pytest.raises(ValueError, match="FLASHDRAFT_API_KEY"):
        cli.run_serve(parse())
    monkeypatch.setenv("FLASHDRAFT_API_KEY", "good-key")
    with pytest.raises(RuntimeError, match="would load"):  # a real key passes the checks
        cli.run_serve(parse())


def test_no_api_key_beyond_loopback_warns(monkeypatch, caplog, pair):
    from flashdraft.serve import cli

    monkeypatch.delenv("FLASHDRAFT_API_KEY", raising=False)
    ran = {}

    class Fake:
        def __init__(self, *a, **kw):
            ran.update(kw)

        def run(self):
            pass

    monkeypatch.setattr(cli, "build_engine", lambda args: (make_engine(pair), MODEL))
    monkeypatch.setattr(cli, "uvicorn_server", lambda app, drain, **kw: Fake(**kw))
    import argparse

    parser = argparse.ArgumentParser(prog="flashdraft")
    cli.add_serve_parser(parser.add_subparsers(dest="command"))
    with caplog.at_level(logging.WARNING, logger="flashdraft.serve"):
        assert cli.run_serve(parser.parse_args(["serve", "--host", "0.0.0.0", "--port", "8123"])) == 0
    assert ran["port"] == 8123 and "no API key" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flashdraft.serve"):
        assert cli.run_serve(parser.parse_args(["serve", "--host", "127.0.0.1"])) == 0
    assert "no API key" not in caplog.text
    assert "target path" in caplog.text  # the start-up line says which forward the target runs


# ---- finding 6: shutdown -------------------------------------------------------------------------------------------

LONG_STREAM = {"model": MODEL, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
               "stream": True}


def _read_stream(url: str, out: list, ready: list):
    lines = []
    try:
        with httpx.stream("POST", f"{url}{C}", timeout=60, json=LONG_STREAM) as resp:
            assert resp.status_code == 200
            ready.append(1)
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
    except Exception as e:  # a cut connection: recorded, the test fails on it
        lines.append(f"EXCEPTION {type(e).__name__}: {e}")
    out.append(lines)


def _start_streams(url: str, n: int):
    results, ready, threads = [], [], []
    for _ in range(n):
        t = threading.Thread(target=_read_stream, args=(url, results, ready), daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + 30
    while len(ready) < n:
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.02)
    return results, threads


def _check_cut_streams(results: list[list[str]], n: int) -> None:
    assert len(results) == n
    for lines in results:
        assert lines and not lines[-1].startswith("EXCEPTION"), lines[-3:]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "shutting_down" and "shut down" in err["message"], err


def test_drain_ends_every_stream_with_an_error_event_and_done(pair):
    """`serve --drain-timeout 1` with 24 long streams (16 running, 8 waiting), then SIGTERM: during the drain
    /health and new requests answer 503; after it every stream gets an error event and [DONE]; nothing is cut at
    the connection level, nothing is logged as a crash, and uvicorn never has to cancel a task."""
    s = serve(pair, slow(make_engine(pair, drafter=False), 0.02), max_batch_size=16, drain_timeout=1.0)
    with Records() as records:  # (after uvicorn configured its loggers)
        try:
            results, threads = _start_streams(s.url, 24)
            time.sleep(0.3)
            assert httpx.get(f"{s.url}/health").json()["running"] == 16
            start = time.perf_counter()
            stopper = threading.Thread(target=s.stop)
            stopper.start()
            time.sleep(0.3)
            draining = httpx.get(f"{s.url}/health", timeout=5)  # still listening while draining
            late = httpx.post(f"{s.url}{C}", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=5)
            for t in threads:
                t.join(timeout=30)
            stopper.join(timeout=30)
            elapsed = time.perf_counter() - start
        finally:
            s.stop()
    assert draining.status_code == 503 and draining.json()["status"] == "draining"
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    _check_cut_streams(results, 24)
    assert not s.thread.is_alive() and elapsed < 4.0, elapsed
    assert records.crashes() == [] and records.cancels() == []


def test_streams_cancelled_by_uvicorn_get_an_error_event_too(pair):
    """A plain uvicorn.Server (no drain hook) whose graceful timeout (1 s) is shorter than the drain (30 s):
    uvicorn cancels the request tasks itself; each stream still ends with an error event and [DONE], and no
    traceback is logged."""
    app = create_app(slow(make_engine(pair, drafter=False), 0.02),
                     ServeConfig(model_name=MODEL, max_model_len=MAX_LEN, drain_timeout=30.0))
    s = Live(app)
    s.server.config.timeout_graceful_shutdown = 1
    with Records() as records:
        results, threads = _start_streams(s.url, 4)
        time.sleep(0.3)
        start = time.perf_counter()
        s.stop()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.perf_counter() - start
    _check_cut_streams(results, 4)
    assert elapsed < 10, elapsed
    assert records.cancels()  # this path was taken
    assert records.crashes() == []
