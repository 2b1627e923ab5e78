"""`flashdraft` command line: generate, demo (the main job on the shipped pair), serve, bench, regenerate, train.

What this module does not know about: anything beyond argument parsing and printing; the work is in the engine,
the loaders and the training package.
"""

from __future__ import annotations

import argparse
import json
import sys

from flashdraft.loading import DefaultPairMissing


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with errors on one line (`prog: error: ...`) instead of the usage block plus the error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ---- argument types: every range check of the shared flags lives here -------------------------------------------

def int_at_least(low: int, note: str = ""):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{note}, got {number}")
        return number

    parse.__name__ = f"int >= {low}"
    return parse


def float_in(low: float, high: float | None = None, low_open: bool = False, note: str = ""):
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        too_low = number <= low if low_open else number < low
        if too_low or (high is not None and number > high) or number != number:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else (
                f"> {low:g}" if low_open else f">= {low:g}")
            raise argparse.ArgumentTypeError(f"must be {'in ' if high is not None else ''}{span}{note}, got {value}")
        return number

    parse.__name__ = "number"
    return parse


def device_arg(value: str) -> str:
    """auto, cpu, cuda, cuda:N (mps): checked now, so a machine without CUDA is told so before any model loads."""
    if value == "auto":
        return value
    from flashdraft.loading import resolve_device

    try:
        resolve_device(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def dtype_arg(value: str) -> str:
    from flashdraft.loading import DTYPE_NAMES

    if value != "auto" and value not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}; use auto or one of {', '.join(DTYPE_NAMES)}")
    return value


positive_int = int_at_least(1)
block_size_arg = int_at_least(2, " (the bonus token plus at least one draft; --no-draft for plain decoding)")
min_tau_arg = float_in(1.0, note=" (an acceptance length: 1 = never fall back)")
temperature_arg = float_in(0.0, 100.0, note=" (0 = greedy)")
top_p_arg = float_in(0.0, 1.0, low_open=True)


def add_model_args(p, threads_help: str = "torch CPU threads (default: torch's choice)") -> None:
    """--target/--draft, the device and precision flags, --block-size and --threads (generate, demo, serve)."""
    p.add_argument("--target", default=None, help="target model directory or hub id (default: the shipped pair; "
                                                  "with --target, pass --draft too)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory or hub id (default: the shipped pair)")
    add_device_args(p)
    p.add_argument("--block-size", type=block_size_arg, default=None, help="draft block size (default: the drafter's)")
    p.add_argument("--threads", type=positive_int, default=None, help=threads_help)


def add_device_args(p) -> None:
    """--device, --dtype, --draft-dtype, --compile, --pack-weights and --min-tau (also used by `flashdraft bench`)."""
    p.add_argument("--device", type=device_arg, default="auto",
                   help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", type=dtype_arg, default="auto",
                   help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--draft-dtype", type=dtype_arg, default="auto",
                   help="the drafter's dtype (default: the target's; bf16 on a CPU with native bf16)")
    p.add_argument("--compile", action="store_true",
                   help="compile the draft and verify steps (torch.compile; CUDA graphs on GPU); slower start")
    p.add_argument("--pack-weights", choices=("auto", "on", "off"), default="auto",
                   help="CPU: run the wide projections through oneDNN on packed weight copies (auto: when the "
                        "copies stay under 2 GiB)")
    p.add_argument("--min-tau", type=min_tau_arg, default=None,
                   help="fall back to one-token steps while drafts keep fewer tokens per cycle than this, probing "
                        "again after 8, 16, 32 ... steps (about the cost of a cycle in decoding steps: ~2.5 on a "
                        "small CPU model; default: always draft)")


def pack_weights_arg(args) -> bool | None:
    return {"auto": None, "on": True, "off": False}[getattr(args, "pack_weights", "auto")]


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=top_p_arg, default=1.0)
    p.add_argument("--top-k", type=int_at_least(0, " (0 = off)"), default=0)
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


def load_models(args, no_draft_hint: str = " (or --no-draft for plain decoding)"):
    """(target, tokenizer, drafter or None) for generate / demo: the shipped pair, or --target with --draft, or
    --target / the shipped target with --no-draft. --target alone is refused: it used to mean plain decoding
    silently, although the help promises speculative decoding."""
    from flashdraft.loading import DEFAULT_TARGET, load_pair, load_target

    no_draft = getattr(args, "no_draft", False)
    if no_draft and args.draft:
        raise ValueError("--no-draft and --draft contradict each other")
    if args.target is not None and args.draft is None and not no_draft:
        raise ValueError(f"--target needs --draft{no_draft_hint}")
    if no_draft:
        if args.target is None and not (DEFAULT_TARGET / "config.json").is_file():
            raise DefaultPairMissing(f"no default model shipped yet: {DEFAULT_TARGET} is missing; pass --target")
        model, tokenizer = load_target(args.target or DEFAULT_TARGET, args.device, args.dtype)
        return model, tokenizer, None
    return load_pair(args.target, args.draft, args.device, args.dtype, args.draft_dtype)


TARGET_GENERATE = "the target's own greedy generate (transformers, unpacked weights)"
TIE_NOTE = ("floating-point near-ties between a multi-token verify and one-token steps can cause this; "
            "see the README for the measured rate")


def target_greedy_generate(target, prompt_ids: list[int], params) -> list[int]:
    """The target's own greedy continuation: transformers' `generate(do_sample=False)` through the model's own
    forward on its own (unpacked) weights, none of our fast path, caches or packed kernels. It runs under a clean
    generation config (no penalties or other defaults from the checkpoint's generation_config.json) with our stop
    ids as its EOS ids and our max_new_tokens, and is cut after the first stop id, as our engine stops."""
    import torch
    from transformers import GenerationConfig

    stops = list(params.stop_token_ids)
    pad = stops[0] if stops else (target.config.pad_token_id if target.config.pad_token_id is not None else 0)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    saved = target.generation_config
    target.generation_config = GenerationConfig(do_sample=False, num_beams=1, eos_token_id=stops or None,
                                                pad_token_id=pad)
    try:
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                  max_new_tokens=params.max_new_tokens, eos_token_id=stops or None,
                                  pad_token_id=pad)
    finally:
        target.generation_config = saved
    tokens = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


def compare_with_target(target, prompt_ids: list[int], params, result) -> dict:
    """Our greedy output against `target_greedy_generate`, token for token, up to the same stop.

    An output cut by a stop string is compared with the same number of the target's tokens (transformers is not
    asked to apply stop strings). Returns {"identical", "tokens", "target_tokens", "first_difference_at"}."""
    ours = list(result.token_ids)
    ref = target_greedy_generate(target, prompt_ids, params)
    stopped_by_string = (result.finish_reason == "stop" and params.stop_strings
                         and not (ours and ours[-1] in params.stop_token_ids))
    if stopped_by_string:
        ref = ref[:len(ours)]
    identical = ours == ref
    first = None
    if not identical:
        n = min(len(ours), len(ref))
        first = next((j for j in range(n) if ours[j] != ref[j]), n)
    return {"identical": identical, "tokens": len(ours), "target_tokens": len(ref), "first_difference_at": first,
            "ours_at_difference": ours[first] if first is not None and first < len(ours) else None,
            "target_at_difference": ref[first] if first is not None and first < len(ref) else None}


def describe_difference(check: dict) -> str:
    j = check["first_difference_at"]
    return (f"first difference at token {j} (ours {check['ours_at_difference']}, target "
            f"{check['target_at_difference']}; {check['tokens']} vs {check['target_tokens']} tokens)")


def run_generate(args) -> int:
    from flashdraft.engine import SamplingParams, SpecEngine

    apply_threads(args)
    target, tokenizer, drafter = load_models(args)
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
    check = None
    if args.compare:
        # plain decoding through our own engine: only the speed ratio (same engine, same kernels)
        baseline = baseline_engine.generate([prompt_ids], params)[0]
        report["baseline"] = {"what": "plain decoding through the same engine (speed baseline)",
                              "tokens_per_second": round(baseline.stats.tokens_per_second, 3),
                              "identical_output": baseline.token_ids == result.token_ids}
        report["speedup"] = round(result.stats.tokens_per_second / max(baseline.stats.tokens_per_second, 1e-9), 3)
        # losslessness: against the target's own transformers generate, not against ourselves
        if params.greedy:
            check = compare_with_target(target, prompt_ids, params, result)
            report["identical_to_target_generate"] = check["identical"]
            report["target_generate"] = {"compared_with": TARGET_GENERATE, **check}
        else:
            report["identical_to_target_generate"] = None
            report["target_generate"] = {"compared_with": TARGET_GENERATE,
                                         "skipped": "sampling (temperature > 0): not comparable token for token"}
    code = 1 if check is not None and not check["identical"] else 0
    if args.json:
        print(json.dumps(report, indent=2))
        return code
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
        print(f"plain decoding (same engine): {b['tokens_per_second']:.1f} tok/s -> speedup {report['speedup']:.2f}x")
        if check is None:
            print(f"not compared with {TARGET_GENERATE}: sampling (temperature > 0)")
        elif check["identical"]:
            print(f"identical to {TARGET_GENERATE}: {check['tokens']}/{check['tokens']} tokens")
        else:
            print(f"DIFFER from {TARGET_GENERATE}: {describe_difference(check)}; {TIE_NOTE}")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="flashdraft", description="Lossless speculative decoding with DFlash drafters")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--no-draft", action="store_true", help="plain decoding (no drafter); with --target")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding through the same engine (speedup) and, greedy, the target's own "
                        "transformers generate (equality check; exit 1 when they differ)")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")
    g.set_defaults(func=run_generate)

    d = sub.add_parser("demo", help="the main job: the shipped pair on held-out prompts, vs plain decoding")
    add_model_args(d)
    d.add_argument("--num-prompts", type=int_at_least(0, " (0 = all)"), default=8, help="0 = all")
    d.add_argument("--max-new-tokens", type=positive_int, default=128)
    d.add_argument("--temperature", type=temperature_arg, default=0.0)
    d.add_argument("--show", type=int_at_least(0), default=2, help="print the generated code of this many prompts")
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
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parsed arguments, or the exit code argparse asked for (2 for a bad flag, 0 for --help)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:
        return None, exc.code if isinstance(exc.code, int) else 2


def main(argv: list[str] | None = None) -> int:
    args, code = parse_args(build_parser(), argv)
    return code if args is None else run_command(args)


if __name__ == "__main__":
    sys.exit(main())
