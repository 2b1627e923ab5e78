"""Property-based fuzzing of the HTTP API (schemathesis, against the server's own /openapi.json), bounded for CI:
every route, schema-valid and schema-violating requests, a fixed (derandomized) example set. No 5xx, no response
outside the documented statuses and schemas, every schema-violating request refused with a 4xx, and the server
healthy and serving afterwards. scripts/fuzz_server.py is the long run of the same thing."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("schemathesis")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import fuzz_server  # noqa: E402

EXAMPLES = 40  # per route and mode


@pytest.fixture(scope="module")
def tiny_server():
    server = fuzz_server.TinyServer(max_model_len=64)
    yield server
    server.stop()


def test_openapi_document_is_served_and_valid(tiny_server):
    doc = httpx.get(f"{tiny_server.url}/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{name}",
                                 "/tokenize", "/detokenize", "/health", "/metrics", "/openapi.json"}
    body = doc["components"]["schemas"]["CompletionRequest"]
    assert body["properties"]["model"]["enum"] == ["tiny"] and "prompt" in body["required"]
    assert body["additionalProperties"] is False


def test_fuzz_every_route(tiny_server):
    lines = []
    report = fuzz_server.fuzz(tiny_server.url, examples=EXAMPLES, shrink=False, derandomize=True, log=lines.append)
    print("\n".join(lines))
    assert report["failures"] == [], "\n\n".join(report["failures"])
    # every route but /openapi.json itself (schemathesis leaves out the operation that serves the schema), both modes
    routes = {label.rsplit(" [", 1)[0] for label in report["runs"]}
    assert routes == {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{name}",
                      "POST /tokenize", "POST /detokenize", "GET /health", "GET /metrics"}
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):
        for mode in ("positive", "negative"):
            assert report["runs"][f"{label} [{mode}]"]["examples"] == EXAMPLES
    ok = report["runs"]["POST /v1/completions [positive]"]["statuses"]
    assert ok.get(200, 0) >= 1, ok  # the generation path itself was exercised, not only refusals
    assert all(status < 500 for run in report["runs"].values() for status in run["statuses"])
    assert report["healthy"], report["health"]
    assert fuzz_server.still_serves(tiny_server.url)
