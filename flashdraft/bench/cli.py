"""`flashdraft bench` (also `python -m flashdraft.bench`): argument parsing, progress bars, and writing the outputs.

In-process mode (default) loads the target, drafter and assistant and runs the methods interleaved prompt by
prompt (`offline.py`); server mode (`--server URL`, repeatable as `name=URL`) sweeps concurrency levels against
OpenAI-compatible endpoints (`server.py`). Both write `results.json`, `results.md` and PNG plots to
`--output-dir` and print a table. Exit codes: 0 ok, 1 a losslessness/output mismatch with `--strict`,
2 bad arguments or unavailable data, 3 the default pair is not shipped.

What this module does not know about: measuring (offline.py, server.py) and formatting (report.py).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from flashdraft.bench.methods import ALL_METHODS, DEFAULT_METHODS, DRAFTER_METHODS
from flashdraft.args import (ArgumentParser, add_device_args, block_size_arg, engine_config, finite_float_in,
                             http_url_arg, int_at_least, output_dir_arg, parse_args, positive_int, seed_arg,
                             temperature_arg, top_p_arg)



def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    try:
        numbers = [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {value!r}")
    return numbers


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    m = p.add_argument_group("models (in-process mode)")
    m.add_argument("--target", default=None, help="target model directory or hub id (default: the shipped pair)")
    m.add_argument("--draft", default=None, help="DFlash drafter directory or hub id (default: the shipped pair)")
    m.add_argument("--no-draft", action="store_true",
                   help="no drafter: run only the methods that need none (ar, hf-assisted, prompt-lookup)")
    m.add_argument("--assistant", default=None,
                   help="small autoregressive draft model for hf-assisted (default: flashdraft/assets/default_pair/"
                        "assistant with the default pair; train one with `python -m flashdraft.bench.assistant`)")
    add_device_args(m)
    m.add_argument("--block-size", type=block_size_arg, default=None,
                   help="DFlash block size (default: the drafter's)")
    m.add_argument("--methods", type=_csv, default=list(DEFAULT_METHODS),
                   help=f"comma-separated subset of {','.join(ALL_METHODS)} (default: all but dflash-fixed, "
                        "dflash-chain, dflash-tree, dflash-drafter, dflash-no-lookup-steps, dflash-no-trim and zlab; "
                        "ar always runs)")
    m.add_argument("--num-assistant-tokens", type=positive_int, default=5,
                   help="hf-assisted: draft tokens per cycle, fixed (schedule constant, confidence threshold 0)")
    m.add_argument("--prompt-lookup-num-tokens", type=positive_int, default=10,
                   help="prompt-lookup: draft tokens per cycle")
    m.add_argument("--max-matching-ngram-size", type=positive_int, default=2,
                   help="prompt-lookup: longest n-gram matched")
    m.add_argument("--zlab-python", default=None,
                   help="zlab: the python of a side environment with z-lab's `dflash` package (default: "
                        "$FLASHDRAFT_ZLAB_PYTHON, else ~/.cache/flashdraft/venv-zlab; scripts/speed/setup_zlab_env.sh "
                        "makes it)")

    d = p.add_argument_group("prompts and decoding")
    d.add_argument("--dataset", type=_csv, default=["default"],
                   help="comma-separated: default (the default pair's held-out code prompts), ood-code, "
                        "ood-code-nl (installed packages' sources, mid-line / ending in a newline), gsm8k, math500, "
                        "humaneval, mbpp, mt-bench, or a .jsonl path with a 'prompt' or 'messages' field")
    d.add_argument("--num-prompts", type=int_at_least(0, " (0 = all)"), default=8,
                   help="first N prompts of each dataset (0 = all)")
    d.add_argument("--cache-dir", type=output_dir_arg, default=None,
                   help="dataset cache (default: ~/.cache/flashdraft/bench or $FLASHDRAFT_BENCH_CACHE)")
    d.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template "
                                                       "(server mode: use /v1/chat/completions)")
    d.add_argument("--max-new-tokens", type=positive_int, default=128)
    d.add_argument("--temperature", type=temperature_arg, default=0.0,
                   help="0 = greedy (default; enables the lossless check)")
    d.add_argument("--top-p", type=top_p_arg, default=1.0)
    d.add_argument("--top-k", type=int_at_least(0, " (0 = off)"), default=0)
    d.add_argument("--seed", type=seed_arg, default=0)
    d.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (fixed output lengths)")

    s = p.add_argument_group("server mode")
    s.add_argument("--server", type=http_url_arg, action="append", default=[], metavar="[NAME=]URL",
                   help="OpenAI-compatible base URL (repeatable; a server named 'ar' is the speedup baseline)")
    s.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 32], help="levels, e.g. 1,4,16,32")
    s.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    s.add_argument("--api", choices=["auto", "completions", "chat"], default="auto",
                   help="auto: chat for 'messages' prompts or --chat, completions otherwise")
    s.add_argument("--num-requests", type=positive_int, default=None,
                   help="requests per level (default: max(number of prompts, concurrency), prompts cycled)")
    s.add_argument("--request-rate", type=finite_float_in(0.0, low_open=True), default=None, metavar="R",
                   help="requests per second, arriving as a seeded Poisson process (the same arrivals for every "
                        "server), at most --concurrency in flight (default: all at once, a closed loop)")
    s.add_argument("--api-key", default=None)

    o = p.add_argument_group("output")
    o.add_argument("--output-dir", type=output_dir_arg, default="runs/bench",
                   help="results.json, results.md and plots go here")
    o.add_argument("--strict", action="store_true", help="exit 1 when a lossless method's greedy output differs")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark DFlash against plain decoding and other speculative methods",
                              description=__doc__.split("\n\n")[1])
    configure_parser(p)
    p.set_defaults(func=run_bench)
    return p


def check_servers_reachable(specs: list[str], api_key: str | None = None, timeout: float = 10.0) -> None:
    """One GET per --server before any prompt is sent: a server that cannot be connected to is one line (exit 2),
    not a traceback, nor a finished run whose every request failed. Any HTTP answer counts as reachable."""
    import httpx

    from flashdraft.bench.server import parse_servers

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for name, base in parse_servers(specs):
        try:
            httpx.get(base + "/v1/models", timeout=timeout, headers=headers)
        except httpx.TransportError as exc:
            raise ValueError(f"--server {base}: cannot connect ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split()) or 'no detail'})") from None


def _has_request(exc) -> bool:
    try:
        exc.request  # httpx raises RuntimeError when an error carries no request
    except RuntimeError:
        return False
    return True


def _environment(target=None, drafter=None, assistant=None) -> dict:
    import torch
    import transformers

    import flashdraft

    env = {"flashdraft": flashdraft.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "torch_threads":
           torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if target is not None:
        env["device"] = str(target.device)
        env["dtype"] = str(target.dtype).replace("torch.", "")
        env["target_params"] = sum(p.numel() for p in target.parameters())
        if target.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(target.device)
    if drafter is not None:
        env["drafter_params"] = sum(p.numel() for p in drafter.parameters())
    if assistant is not None:
        env["assistant_params"] = sum(p.numel() for p in assistant.parameters())
    return env


def _progress(enabled: bool):
    from contextlib import nullcontext

    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)


def check_optional_imports(args) -> None:
    """Fail before any model work when an optional dependency this run needs is missing (plots, server mode),
    with one line naming the extra, instead of losing a finished run at the end."""
    import importlib.util

    needed = [] if args.no_plots else [("matplotlib", "the plots (or pass --no-plots)")]
    if args.server:
        needed.append(("httpx", "server mode"))
    for module, purpose in needed:
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{module} is not installed; it is needed for {purpose}: pip install 'flashdraft[bench]'")


def _methods_for(args) -> list[str]:
    """--methods, checked against --target / --draft / --no-draft before anything loads."""
    unknown = [m for m in args.methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(ALL_METHODS)}")
    no_draft = getattr(args, "no_draft", False)
    if no_draft and args.draft:
        raise ValueError("--no-draft and --draft contradict each other")
    if no_draft:
        return [m for m in args.methods if m not in DRAFTER_METHODS]
    needing = [m for m in args.methods if m in DRAFTER_METHODS]
    if args.target is not None and args.draft is None and needing:
        raise ValueError(f"--target needs --draft for {', '.join(needing)} (or --no-draft to run only the methods "
                         "without a drafter: ar, hf-assisted, prompt-lookup)")
    return list(args.methods)


def run_bench(args, extra_methods=None, console=None) -> int:
    """Run from parsed arguments. `extra_methods`: more `Method`s for in-process mode (tests)."""
    from rich.console import Console

    from flashdraft.bench import report
    from flashdraft.bench.datasets import DatasetUnavailable, dataset_label, load_prompts

    check_optional_imports(args)

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: a table wide enough not to wrap
            console = Console(width=max(console.width, 132))
    out_dir = Path(args.output_dir)
    num_prompts = args.num_prompts or None
    try:
        if args.server:
            check_servers_reachable(args.server, args.api_key)
            prompts = []
            for spec in args.dataset:
                prompts += load_prompts(spec, num_prompts, args.cache_dir)
            if args.chat:
                from flashdraft.bench.datasets import Prompt

                prompts = [Prompt(messages=p.as_messages()) for p in prompts]
            with _progress(not args.no_progress) as progress:
                import httpx

                from flashdraft.bench.server import run_servers

                try:
                    results = run_servers(args.server, prompts, args.concurrency, model=args.model, api=args.api,
                                          max_tokens=args.max_new_tokens, temperature=args.temperature,
                                          top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                                          num_requests=args.num_requests, api_key=args.api_key, progress=progress,
                                          request_rate=args.request_rate)
                except httpx.HTTPError as exc:  # unreachable server, refused connection, HTTP error status
                    where = exc.request.url if _has_request(exc) else None
                    raise ValueError(f"--server: {'cannot use ' + str(where) if where else 'request failed'} "
                                     f"({type(exc).__name__}: {exc or 'no detail'})") from exc
            results["config"] = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
            results["datasets_used"] = [dataset_label(d) for d in args.dataset]
            results["environment"] = _environment()
        else:
            from flashdraft.bench.offline import BenchConfig, load_models, run_offline

            methods = _methods_for(args)
            cfg = BenchConfig(target=args.target, draft=args.draft, assistant=args.assistant, methods=methods,
                              datasets=args.dataset, num_prompts=num_prompts, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              chat=args.chat, ignore_eos=args.ignore_eos,
                              num_assistant_tokens=args.num_assistant_tokens,
                              prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
                              max_matching_ngram_size=args.max_matching_ngram_size, device=args.device,
                              dtype=args.dtype, draft_dtype=args.draft_dtype, engine=engine_config(args),
                              cache_dir=args.cache_dir, zlab_python=args.zlab_python)
            if cfg.target is None:
                from flashdraft.loading import default_pair_paths

                default_pair_paths()  # DefaultPairMissing (exit 3) before any other complaint
            datasets = {dataset_label(d): load_prompts(d, num_prompts, args.cache_dir) for d in cfg.datasets}
            target, tokenizer, drafter, assistant = load_models(cfg)
            with _progress(not args.no_progress) as progress:
                results = run_offline(cfg, target, tokenizer, drafter, assistant, extra_methods=extra_methods,
                                      progress=progress, datasets=datasets)
            results["environment"] = _environment(target, drafter, assistant)
    except DatasetUnavailable as exc:
        print(f"flashdraft bench: {exc}", file=sys.stderr)
        return 2

    out_dir.mkdir(parents=True, exist_ok=True)
    failures = report.lossless_failures(results)
    results["exit"] = {"strict": bool(args.strict), "lossless_failures": failures}
    # the numbers first: whatever happens while plotting, a run of minutes is not lost
    report.write_json(results, out_dir / "results.json")
    report.write_markdown(results, out_dir / "results.md")
    if not args.no_plots:
        results["plots"] = [Path(p).name for p in report.write_plots(results, out_dir)]
        report.write_json(results, out_dir / "results.json")  # again, now listing the plots
    report.print_tables(results, console)
    console.print(f"results: {out_dir / 'results.json'}, {out_dir / 'results.md'}"
                  + (f", plots: {', '.join(results['plots'])}" if results.get("plots") else ""))
    if failures and args.strict:
        console.print("[bold red]--strict: exiting with status 1 (output mismatch)[/bold red]")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="flashdraft bench", description=__doc__.split("\n\n")[1])
    configure_parser(parser)
    parser.set_defaults(func=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from flashdraft.args import run_command

    args, code = parse_args(build_parser(), argv)
    return code if args is None else run_command(args, prog="flashdraft bench")
