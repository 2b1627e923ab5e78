"""`flashdraft serve`: an OpenAI-compatible HTTP server with continuous batching over `SpecEngine`.

- `protocol.py`  request models (strict pydantic), OpenAI error bodies, response/chunk builders;
- `scheduler.py` the one thread that owns the engine: requests join/leave the live batch between cycles;
- `metrics.py`   Prometheus metrics (vLLM's spec-decode counter names, latency histograms, gauges);
- `app.py`       the FastAPI routes, streaming, disconnect handling, auth, error mapping;
- `cli.py`       `add_serve_parser` for `flashdraft serve`, model loading, uvicorn;
- `loadtest.py`  a minimal concurrent load generator (throughput vs concurrency).

Nothing here imports FastAPI at package import time; `create_app` needs the `serve` extra.
"""


def create_app(*args, **kwargs):
    from flashdraft.serve.app import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
