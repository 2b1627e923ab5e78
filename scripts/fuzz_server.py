"""Property-based fuzzing of `flashdraft serve`'s HTTP API with schemathesis, against the server's own schema
(GET /openapi.json): every route, schema-valid (positive) and schema-violating (negative) requests.

    python scripts/fuzz_server.py                       # a tiny random pair served on 127.0.0.1, 300 examples a route
    python scripts/fuzz_server.py --examples 2000 --seed 7
    python scripts/fuzz_server.py --url http://127.0.0.1:8000   # a server already running (loopback only)

Pass criteria, per request: no HTTP 5xx (`not_a_server_error`), the status code is one the schema documents, the
content type and the body match the documented response (`response_schema_conformance`), and a schema-violating
request is refused with a 4xx (`negative_data_rejection`). Not checked: that every schema-valid request succeeds
(`positive_data_acceptance`), since a schema cannot state some refusals (a prompt longer than the context in
tokens, a full queue). After the run the server must still answer /health with "ok" and serve a completion.
Prints one line per route and mode (examples sent, status codes seen) and every failure; exit status 1 on any.

`fuzz(url, ...)` is the same run as a function (tests/test_serve_fuzz.py runs it with few examples).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checks():
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            negative_data_rejection]


def fuzz(url: str, examples: int = 300, seed: int | None = None, modes=("positive", "negative"),
         shrink: bool = True, derandomize: bool = False, timeout: float = 60.0, log=print) -> dict:
    """Fuzz every operation of the server at `url` in each mode; a report: {"runs": {label: {"examples",
    "statuses"}}, "failures": [text], "healthy": bool}."""
    import httpx
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from hypothesis import HealthCheck, Phase
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    report = {"runs": {}, "failures": []}
    selected = checks()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in modes:
            label = f"{operation.label} [{mode}]"
            statuses: Counter = Counter()

            @hypothesis.settings(max_examples=examples, deadline=None, database=None, phases=phases,
                                 suppress_health_check=list(HealthCheck), derandomize=derandomize)
            @hypothesis.given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
            def run(case):
                response = case.call(base_url=url, timeout=timeout)
                statuses[response.status_code] += 1
                case.validate_response(response, checks=selected)

            if seed is not None:
                run = hypothesis.seed(seed)(run)
            start = time.perf_counter()
            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # nothing to violate (no parameters, or any string is valid)
                report["runs"][label] = {"examples": 0, "statuses": {}, "seconds": 0.0, "note": "no such cases"}
                log(f"{label:45s} no {mode} cases exist")
                continue
            except Exception as e:  # a failed check (hypothesis re-raises the minimal example's failure)
                report["failures"].append(f"{label}: {type(e).__name__}: {e}")
            sent = sum(statuses.values())
            report["runs"][label] = {"examples": sent, "statuses": dict(sorted(statuses.items())),
                                     "seconds": round(time.perf_counter() - start, 2)}
            log(f"{label:45s} {sent:5d} requests in {report['runs'][label]['seconds']:6.1f}s  "
                f"statuses {dict(sorted(statuses.items()))}")
    health = httpx.get(f"{url}/health", timeout=10)
    report["health"] = health.json()
    report["healthy"] = health.status_code == 200 and health.json().get("status") == "ok"
    return report


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def still_serves(url: str) -> bool:
    """A plain completion works after the fuzzing."""
    import httpx

    resp = httpx.post(f"{url}/v1/completions", json={"model": _served_model(url), "prompt": "def f(x):",
                                                     "max_tokens": 4, "temperature": 0}, timeout=60)
    return resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


class TinyServer:
    """A tiny random target + DFlash drafter (tests/tiny.py) behind `flashdraft serve`'s app and uvicorn server on
    a free 127.0.0.1 port, in a background thread."""

    def __init__(self, max_model_len: int = 96, **config):
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import save_text_pair

        from flashdraft.engine import SpecEngine
        from flashdraft.loading import load_pair
        from flashdraft.serve.app import ServeConfig, create_app
        from flashdraft.serve.cli import uvicorn_server

        self._dir = tempfile.TemporaryDirectory(prefix="fuzz_pair_")
        root = Path(self._dir.name)
        save_text_pair(root, max_positions=256)
        target, tokenizer, drafter = load_pair(root / "target", root / "drafter", "cpu", "float32")
        tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                                   "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
        self.app = create_app(SpecEngine(target, drafter, tokenizer),
                              ServeConfig(model_name="tiny", max_model_len=max_model_len, **config))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn_server(self.app, 5.0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self._dir.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="fuzz this server (loopback) instead of starting a tiny one")
    p.add_argument("--examples", type=int, default=300, help="examples per route and mode (default 300)")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    p.add_argument("--modes", default="positive,negative", help="positive, negative or both (default both)")
    p.add_argument("--no-shrink", action="store_true", help="report failures as found, without minimising them")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if args.url:
        host = args.url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
            p.error("--url must be a loopback address")
    server = None if args.url else TinyServer()
    url = args.url or server.url
    start = time.perf_counter()
    try:
        report = fuzz(url, args.examples, args.seed, tuple(args.modes.split(",")), shrink=not args.no_shrink)
        report["serves_after"] = still_serves(url)
    finally:
        if server is not None:
            server.stop()
    total = sum(r["examples"] for r in report["runs"].values())
    statuses = Counter()
    for r in report["runs"].values():
        statuses.update(r["statuses"])
    print(f"\n{total} requests in {time.perf_counter() - start:.0f}s; statuses {dict(sorted(statuses.items()))}; "
          f"5xx: {sum(n for s, n in statuses.items() if int(s) >= 500)}; failures: {len(report['failures'])}; "
          f"healthy after: {report['healthy']}; serves after: {report['serves_after']}")
    for failure in report["failures"]:
        print(f"\nFAILURE {failure}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0 if not report["failures"] and report["healthy"] and report["serves_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
