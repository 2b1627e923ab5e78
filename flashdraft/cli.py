"""`flashdraft` command line: generate, demo (the main job on the shipped pair), serve, bench, regenerate, train.

What this module does not know about: anything beyond argument parsing and printing; the work is in the engine,
the loaders and the training package.
"""

from __future__ import annotations

import argparse
import json
import sys

from flashdraft.loading import DefaultPairMissing


def add_model_args(p, threads_help: str = "torch CPU threads (default: torch's choice)") -> None:
    """--target/--draft, the device and precision flags, --block-size and --threads (generate, demo, serve)."""
    p.add_argument("--target", default=None, help="target model directory or hub id (default: the shipped pair)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory or hub id (default: the shipped pair)")
    add_device_args(p)
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    p.add_argument("--threads", type=int, default=None, help=threads_help)


def add_device_args(p) -> None:
    """--device, --dtype, --draft-dtype, --compile, --pack-weights and --min-tau (also used by `flashdraft bench`)."""
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--draft-dtype", default="auto",
                   help="the drafter's dtype (default: the target's; bf16 on a CPU with native bf16)")
    p.add_argument("--compile", action="store_true",
                   help="compile the draft and verify steps (torch.compile; CUDA graphs on GPU); slower start")
    p.add_argument("--pack-weights", choices=("auto", "on", "off"), default="auto",
                   help="CPU: run the wide projections through oneDNN on packed weight copies (auto: when the "
                        "copies stay under 2 GiB)")
    p.add_argument("--min-tau", type=float, default=None,
                   help="fall back to one-token steps while drafts keep fewer tokens per cycle than this, probing "
                        "again after 8, 16, 32 ... steps (about the cost of a cycle in decoding steps: ~2.5 on a "
                        "small CPU model; default: always draft)")


def pack_weights_arg(args) -> bool | None:
    return {"auto": None, "on": True, "off": False}[getattr(args, "pack_weights", "auto")]


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args, tokenizer):
    from flashdraft.engine import SamplingParams

    stop_ids = ()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop_ids = (int(tokenizer.eos_token_id),)
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop_token_ids=stop_ids, stop_strings=tuple(args.stop))


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    return ids


def histogram_lines(histogram: list[int], width: int = 40) -> list[str]:
    total = max(1, sum(histogram))
    peak = max(1, max(histogram))
    return [f"{i + 1:>3} | {'#' * round(width * c / peak):<{width}} {c:>5} ({100 * c / total:4.1f}%)"
            for i, c in enumerate(histogram)]


def apply_threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def run_generate(args) -> int:
    from flashdraft.engine import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair

    apply_threads(args)
    target, tokenizer, drafter = load_pair(args.target, args.draft, args.device, args.dtype, args.draft_dtype)
    if tokenizer is None:
        print("error: the target has no tokenizer; use the Python API with token ids", file=sys.stderr)
        return 2
    params = _sampling_params(args, tokenizer)
    prompt_ids = _encode(tokenizer, args.prompt, args.chat)
    pack = pack_weights_arg(args)
    engine = SpecEngine(target, drafter, tokenizer, block_size=args.block_size, compile=args.compile, pack_weights=pack,
                        min_tau=args.min_tau)
    baseline_engine = None
    if args.compare:
        baseline_engine = SpecEngine(target, None, tokenizer, compile=args.compile, pack_weights=pack)
    if args.compare:  # warm both up so that neither pays first-call costs inside the timed run
        for e in (engine, baseline_engine):
            e.generate([prompt_ids], SamplingParams(max_new_tokens=4))
    if args.stream and not args.json:
        for event in engine.stream([prompt_ids], params):
            print(event.text or "", end="", flush=True)
            result = event.result
        print()
    else:
        result = engine.generate([prompt_ids], params)[0]
    report = {"prompt": args.prompt, "text": result.text, "finish_reason": result.finish_reason,
              "stats": result.stats.to_dict()}
    if args.compare:
        baseline = baseline_engine.generate([prompt_ids], params)[0]
        report["baseline"] = {"tokens_per_second": round(baseline.stats.tokens_per_second, 3),
                              "identical_output": baseline.token_ids == result.token_ids}
        report["speedup"] = round(result.stats.tokens_per_second / max(baseline.stats.tokens_per_second, 1e-9), 3)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not args.stream:
        print(args.prompt + result.text)
    s = result.stats
    plain = f", {s.plain_steps} one-token steps" if s.plain_steps else ""
    print(f"\n-- {s.output_tokens} tokens, finish={result.finish_reason}, tau={s.tau:.2f} "
          f"(block {s.block_size}{plain}), {s.tokens_per_second:.1f} tok/s, ttft {1000 * s.time_to_first_token:.1f} ms")
    if s.num_drafts:
        print("acceptance length histogram:")
        print("\n".join(histogram_lines(s.histogram)))
    if args.compare:
        b = report["baseline"]
        print(f"plain decoding: {b['tokens_per_second']:.1f} tok/s -> speedup {report['speedup']:.2f}x, "
              f"identical output: {b['identical_output']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description="Lossless speculative decoding with DFlash drafters")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--compare", action="store_true", help="also run plain decoding: speedup and equality check")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")
    g.set_defaults(func=run_generate)

    d = sub.add_parser("demo", help="the main job: the shipped pair on held-out prompts, vs plain decoding")
    add_model_args(d)
    d.add_argument("--num-prompts", type=int, default=8)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--show", type=int, default=2, help="print the generated code of this many prompts")
    d.add_argument("--json", default=None, help="also write the results to this JSON file")
    d.set_defaults(func=lambda a: __import__("flashdraft.demo", fromlist=["run"]).run(a))

    from flashdraft.bench.cli import add_bench_parser
    from flashdraft.serve.cli import add_serve_parser
    from flashdraft.train.cli import add_regenerate_parser, add_train_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_regenerate_parser(sub)
    add_train_parser(sub)
    return parser


def run_command(args, prog: str = "flashdraft") -> int:
    """Run a parsed subcommand; user errors print one line (exit 2), a missing default pair exits 3."""
    try:
        return int(args.func(args) or 0)
    except DefaultPairMissing as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
