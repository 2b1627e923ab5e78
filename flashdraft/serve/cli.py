"""`flashdraft serve`: load the pair, build the engine and the app, run uvicorn.

`add_serve_parser(subparsers)` mounts the subcommand on the main `flashdraft` parser (it sets `func=run_serve`);
`python -m flashdraft.serve.cli ...` runs it standalone. FastAPI/uvicorn are imported only when the server starts, so
the rest of the CLI works without the `serve` extra.

Flags are checked before anything loads: `--port` in 1..65535, finite non-negative timeouts, positive sizes. An
empty `--api-key` (or an empty $FLASHDRAFT_API_KEY) is an error, not a silently open server: omit the flag to serve
without authentication (a warning is logged when such a server listens beyond loopback). `uvicorn_server` is
uvicorn's server with one change: on SIGINT/SIGTERM it drains the app first (`Server.drain`: --drain-timeout
seconds for in-flight requests, then an error event and [DONE] for each stream still running), and only then lets
uvicorn close the connections, so no stream is cut at the connection level.

What this module does not know about: HTTP routes, batching, the OpenAI format (`app.py`, `scheduler.py`,
`protocol.py`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from flashdraft.args import add_model_args, engine_from_args, int_at_least, int_in
from flashdraft.memory import kv_bytes_per_position, memory_budget_arg, resolve_memory_budget
from flashdraft.serve.tools import PARSERS

API_KEY_ENV = "FLASHDRAFT_API_KEY"


def _seconds(low_open: bool):
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
        if not math.isfinite(number) or number < 0 or (low_open and number == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {'> 0' if low_open else '>= 0'}, "
                                             f"got {value}")
        return number

    parse.__name__ = "seconds"
    return parse


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve /v1/completions and /v1/chat/completions (streaming included) with DFlash speculative "
                    "decoding and continuous batching; /metrics for Prometheus, /health, /openapi.json.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int_in(1, 65535, " (a TCP port)"), default=8000, help="TCP port, 1..65535 (default 8000)")
    add_model_args(p, threads_help="CPU threads for the engine (default: 1 on CPU, where more threads measured slower)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (the AR baseline)")
    p.add_argument("--max-batch-size", type=int, default=16, help="rows decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for a batch slot; beyond that the server answers 429 (default 64)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="order of the requests waiting for a batch slot: fcfs = first come first served (a request "
                        "with a nonzero priority is a 400); priority = by each request's `priority`, lower first, "
                        "then arrival, and under --kv-cache-memory the least urgent running request is preempted "
                        "first (vLLM's; default fcfs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion token limit (default: the target's max_position_embeddings)")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="prompt tokens prefilled per scheduler step when requests join, those the prefix cache "
                        "gives not counted (default 8192)")
    p.add_argument("--mixed-prefill-tokens", type=int_at_least(0), default=None,
                   help="requests joining a running batch with at most this many prompt tokens in all are prefilled "
                        "inside the running rows' next cycle (one target forward), longer ones in a prefill of their "
                        "own; 0 = always apart (default 512; eager fast path, not with --exact or --tree-budget)")
    p.add_argument("--kv-cache-memory", type=memory_budget_arg, default=None,
                   help="memory for the target's and drafter's KV caches: GiB (24 or 24GiB), or a percentage of the "
                        "device's memory for the whole server (90%%: less what the weights already use; CPU: of "
                        "RAM). Requests wait in the queue while the batch, grown by a chunk per row, would exceed "
                        "it; running rows that outgrow it are preempted and recomputed later; one that cannot fit "
                        "alone is a 400 (default: no bound beyond --max-batch-size)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the full pages of prompts and answers (the target's K/V and the features the drafter "
                        "reads) so a later prompt that starts with the same tokens (a shared system prompt, a "
                        "conversation's next turn) computes only the rest (vLLM's flag; fast target path, not with "
                        "--exact; default on)")
    p.add_argument("--prefix-cache-memory", type=memory_budget_arg, default=("GiB", 1.0),
                   help="memory the prefix cache may take as pages come: GiB or a percentage of the device's memory "
                        "(default 1 GiB); beside a --kv-cache-memory in GiB, out of one given as a percentage (of "
                        "the whole server's memory); least recently used pages leave first")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; without either the "
                        "server is open; an empty key is an error)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the target directory's name)")
    p.add_argument("--drain-timeout", type=_seconds(low_open=False), default=30.0,
                   help="on shutdown, seconds in-flight requests get to finish before they are cancelled with an "
                        "error (default 30)")
    p.add_argument("--max-body-bytes", type=int_at_least(1024), default=8 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413 (default 8 MiB)")
    p.add_argument("--body-timeout", type=_seconds(low_open=True), default=30.0,
                   help="seconds a client gets to send a whole request body; slower ones get 408 (default 30)")
    p.add_argument("--max-prompt-bytes", type=int_at_least(1), default=None,
                   help="longest prompt text (UTF-8 bytes) tokenized; longer ones are a 400 before tokenizing "
                        "(default: max-model-len x the longest vocabulary entry, which no fitting prompt exceeds)")
    p.add_argument("--cycle-trace", default=None, metavar="PATH",
                   help="append one JSON line per decode cycle to PATH: the requests in the batch, each one's verify "
                        "width (1: a one-token step) and drafts accepted, requests that joined, how the draft policy "
                        "decided (plan / held / kept / probe / refresh / unmeasured; capped: above "
                        "--speculative-disable-by-batch-size), the tokens each lookup step "
                        "verified, the cycle's ms (default: off)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the Jinja template /v1/chat/completions formats messages with: a file, or the template "
                        "itself (default: the tokenizer's own; a model without one answers chat requests 400)")
    p.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                   help="read tool calls out of the model's text for tool_choice 'auto' (OpenAI's default with "
                        "tools): hermes = <tool_call>{...}</tool_call> blocks (Qwen2.5 / Qwen3 templates). Without "
                        "it, 'auto' is a 400; 'required', a named function and 'none' work regardless")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)
    return p


def _positive(args, *names) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_api_key(key: str | None) -> str | None:
    """The key to require, or None for an open server; an empty or blank key is a mistake, not "no key"."""
    if key is None:
        return None
    where = f"--api-key (or ${API_KEY_ENV})"
    if not key.strip():
        raise ValueError(f"{where} is empty: it would leave the server open to anyone; pass a real key, or omit "
                         f"{where} to serve without authentication")
    if key != key.strip() or not key.isprintable() or not key.isascii():
        raise ValueError(f"{where} must be printable ASCII without surrounding spaces (clients send it in an HTTP "
                         "header)")
    return key


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def chat_template_text(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the template itself (read before the models load)."""
    if value is None or "{{" in value or "{%" in value:
        return value
    if not Path(value).is_file():
        raise ValueError(f"--chat-template {value}: no such file (nor a Jinja template)")
    return Path(value).read_text()


def set_chat_template(tokenizer, template: str | None) -> None:
    """The template on the tokenizer, once it renders a one-message conversation: a template that cannot is
    refused at start-up, not on the first chat request."""
    if template is None:
        return
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja's syntax and render errors, a template reading fields that are not there
        raise ValueError(f"--chat-template does not render a one-message conversation: {e}") from None


def build_engine(args):
    """(SpecEngine, served model name) from the command-line options."""
    from flashdraft.loading import DEFAULT_TARGET, DefaultPairMissing, load_pair, load_target

    if args.no_draft and args.draft:
        raise ValueError("--no-draft and --draft contradict each other")
    if args.target and not args.draft and not args.no_draft:
        raise ValueError("--target needs --draft (or --no-draft for plain decoding)")
    target_path = args.target or DEFAULT_TARGET
    template = chat_template_text(args.chat_template)
    if args.no_draft:
        if args.target is None and not (DEFAULT_TARGET / "config.json").is_file():
            raise DefaultPairMissing(f"no default model shipped yet: {DEFAULT_TARGET} is missing; pass --target")
        model, tokenizer = load_target(target_path, args.device, args.dtype)
        drafter = None
    else:
        model, tokenizer, drafter = load_pair(args.target, args.draft, args.device, args.dtype, args.draft_dtype)
    if tokenizer is None:
        raise ValueError("the target has no tokenizer; the server needs one to encode prompts")
    set_chat_template(tokenizer, template)
    args.prefix_cache_tokens = prefix_cache_tokens(args, model, drafter)
    engine = engine_from_args(args, model, drafter, tokenizer)
    name = args.served_model_name or str(target_path).rstrip("/").split("/")[-1]
    return engine, name


def prefix_cache_tokens(args, model, drafter) -> int:
    """Positions `--prefix-cache-memory` holds for this pair: the target's K/V and, with a drafter, the tapped
    features of each (0 with --no-enable-prefix-caching)."""
    if not args.enable_prefix_caching or args.exact:  # exact mode computes each prompt whole
        return 0
    budget = resolve_memory_budget(args.prefix_cache_memory, model.device, "--prefix-cache-memory")
    return budget // prefix_position_bytes(model.config, model.dtype, drafter)


def prefix_position_bytes(config, dtype, drafter) -> int:
    """Bytes of one position in the prefix cache's store: the target's K/V and, with a drafter, its tapped features."""
    per_position = kv_bytes_per_position(config, dtype)
    if drafter is not None:
        per_position += len(drafter.target_layer_ids) * config.get_text_config().hidden_size * dtype.itemsize
    return per_position


def kv_cache_bytes(args, engine) -> int | None:
    """`--kv-cache-memory` in bytes (None: no budget). A percentage is of the device's memory for the whole server,
    so the prefix cache's store, which grows after this is read, comes out of it."""
    if not args.kv_cache_memory:
        return None
    budget = resolve_memory_budget(args.kv_cache_memory, engine.target.device)
    if args.kv_cache_memory[0] == "percent" and engine.prefix_cache is not None:  # the store's own bound
        budget -= engine.config.prefix_cache_tokens * prefix_position_bytes(engine.target.config, engine.target.dtype,
                                                                            engine.drafter)
        if budget <= 0:
            raise ValueError(f"--kv-cache-memory {args.kv_cache_memory[1]:g}% leaves nothing for the KV cache beside "
                             "--prefix-cache-memory; raise the one or lower the other")
    return budget


def open_cycle_trace(path: str | None):
    """The `--cycle-trace` file, opened for appending (line-buffered: a line per cycle as it ends), or None."""
    if path is None:
        return None
    try:
        return open(path, "a", buffering=1)
    except OSError as e:
        raise ValueError(f"--cycle-trace {path}: cannot write it ({e.strerror or e})") from None


def uvicorn_server(app, drain_timeout: float, **config):
    """A uvicorn.Server for `app` (a `create_app` app) that drains the app before uvicorn's own shutdown: SIGTERM
    -> /health 503, new requests 503, in-flight ones get `drain_timeout` s, then each remaining stream gets an
    error event and [DONE] -> uvicorn closes the (by then idle) connections. `config` goes to uvicorn.Config."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            try:
                await app.state.server.drain(drain_timeout)
            finally:
                await super().shutdown(sockets)

    config.setdefault("timeout_graceful_shutdown", 5)  # after the drain: time to flush the last events
    return DrainingServer(uvicorn.Config(app, **config))


def run_serve(args) -> int:
    _positive(args, "max_batch_size", "max_model_len", "max_prefill_tokens", "port", "block_size")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be a TCP port in 1..65535, got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    api_key = check_api_key(args.api_key)
    try:
        import uvicorn  # noqa: F401

        from flashdraft.serve.app import ServeConfig, create_app
    except ImportError as e:
        print(f"flashdraft serve needs the serve extra: pip install 'flashdraft[serve]' ({e})", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trace = open_cycle_trace(args.cycle_trace)
    engine, name = build_engine(args)
    if trace is not None:
        engine.cycle_trace = lambda record: trace.write(json.dumps(record, default=str) + "\n")
    config = ServeConfig(model_name=name, max_model_len=args.max_model_len, max_batch_size=args.max_batch_size,
                         max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                         api_key=api_key, drain_timeout=args.drain_timeout, threads=args.threads,
                         max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                         max_prompt_bytes=args.max_prompt_bytes, tool_call_parser=args.tool_call_parser,
                         scheduling_policy=args.scheduling_policy,
                         kv_cache_bytes=kv_cache_bytes(args, engine))
    app = create_app(engine, config)
    log = logging.getLogger("flashdraft.serve")
    if api_key is None and not _is_loopback(args.host):
        log.warning("no API key: anyone who can reach %s:%d can use this server (pass --api-key or set $%s)",
                    args.host, args.port, API_KEY_ENV)
    if engine.block_size > 1 or args.compile:
        log.info("%s the draft and verify steps for batches of up to %d rows ...",
                 "compiling and timing" if args.compile else "timing", args.max_batch_size)
        start = time.perf_counter()
        buckets = engine.warmup(args.max_batch_size)
        log.info("warmed up for batch buckets %s in %.0f s", buckets, time.perf_counter() - start)
    if engine.prefix_cache is not None:
        log.info("prefix cache: up to %d positions of prompts and answers, in pages of %d",
                 engine.config.prefix_cache_tokens, engine.prefix_cache.page_size)
    mode = f"DFlash block {engine.block_size}" if engine.block_size > 1 else "plain decoding"
    log.info("serving %r (%s, %s) on http://%s:%d", name, mode, engine.target_path, args.host, args.port)
    uvicorn_server(app, args.drain_timeout, host=args.host, port=args.port, log_level=args.log_level).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    from flashdraft.args import run_command

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
