"""`flashdraft serve`: load the pair, build the engine and the app, run uvicorn.

`add_serve_parser(subparsers)` mounts the subcommand on the main `flashdraft` parser (it sets `func=run_serve`);
`python -m flashdraft.serve.cli ...` runs it standalone. FastAPI/uvicorn are imported only when the server starts, so
the rest of the CLI works without the `serve` extra.

What this module does not know about: HTTP routes, batching, the OpenAI format (`app.py`, `scheduler.py`,
`protocol.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from flashdraft.args import add_model_args, engine_from_args


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve /v1/completions and /v1/chat/completions (streaming included) with DFlash speculative "
                    "decoding and continuous batching; /metrics for Prometheus, /health.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    add_model_args(p, threads_help="CPU threads for the engine (default: 1 on CPU, where more threads measured slower)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (the AR baseline)")
    p.add_argument("--max-batch-size", type=int, default=16, help="rows decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for a batch slot; beyond that the server answers 429 (default 64)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion token limit (default: the target's max_position_embeddings)")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="prompt tokens prefilled per scheduler step when requests join (default 8192)")
    p.add_argument("--api-key", default=os.environ.get("FLASHDRAFT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $FLASHDRAFT_API_KEY, else open)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the target directory's name)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on shutdown, seconds in-flight requests get to finish before they are cancelled")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)
    return p


def _positive(args, *names) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def build_engine(args):
    """(SpecEngine, served model name) from the command-line options."""
    from flashdraft.loading import DEFAULT_TARGET, DefaultPairMissing, load_pair, load_target

    if args.no_draft and args.draft:
        raise ValueError("--no-draft and --draft contradict each other")
    if args.target and not args.draft and not args.no_draft:
        raise ValueError("--target needs --draft (or --no-draft for plain decoding)")
    target_path = args.target or DEFAULT_TARGET
    if args.no_draft:
        if args.target is None and not (DEFAULT_TARGET / "config.json").is_file():
            raise DefaultPairMissing(f"no default model shipped yet: {DEFAULT_TARGET} is missing; pass --target")
        model, tokenizer = load_target(target_path, args.device, args.dtype)
        drafter = None
    else:
        model, tokenizer, drafter = load_pair(args.target, args.draft, args.device, args.dtype, args.draft_dtype)
    if tokenizer is None:
        raise ValueError("the target has no tokenizer; the server needs one to encode prompts")
    engine = engine_from_args(args, model, drafter, tokenizer)
    name = args.served_model_name or str(target_path).rstrip("/").split("/")[-1]
    return engine, name


def run_serve(args) -> int:
    _positive(args, "max_batch_size", "max_model_len", "max_prefill_tokens", "port", "block_size")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    try:
        import uvicorn

        from flashdraft.serve.app import ServeConfig, create_app
    except ImportError as e:
        print(f"flashdraft serve needs the serve extra: pip install 'flashdraft[serve]' ({e})", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, name = build_engine(args)
    config = ServeConfig(model_name=name, max_model_len=args.max_model_len, max_batch_size=args.max_batch_size,
                         max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                         api_key=args.api_key or None, drain_timeout=args.drain_timeout, threads=args.threads)
    app = create_app(engine, config)
    log = logging.getLogger("flashdraft.serve")
    if args.compile:
        log.info("compiling the draft and verify steps for batches of up to %d rows ...", args.max_batch_size)
        start = time.perf_counter()
        buckets = engine.warmup(args.max_batch_size)
        log.info("compiled for batch buckets %s in %.0f s", buckets, time.perf_counter() - start)
    mode = f"DFlash block {engine.block_size}" if engine.block_size > 1 else "plain decoding"
    log.info("serving %r (%s) on http://%s:%d", name, mode, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout + 5)
    return 0


def main(argv: list[str] | None = None) -> int:
    from flashdraft.args import run_command

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
