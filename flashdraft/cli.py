"""`flashdraft` command line: generate, demo (the main job on the shipped pair), serve, bench, regenerate, train.

What this module does not know about: anything beyond argument parsing and printing; the work is in the engine,
the loaders and the training package.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from flashdraft.args import (ArgumentParser, add_model_args, add_structured_args, apply_threads, engine_from_args,
                             histogram_lines, int_at_least, int_in, load_models, parse_args, positive_int, run_command,
                             min_p_arg, seed_arg, structured_output_from_args, temperature_arg, top_p_arg)
from flashdraft.bench.reference import TARGET_GENERATE, TIE_NOTE, compare_with_target, describe_difference
from flashdraft.engine.logprobs import MAX_LOGPROBS


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=top_p_arg, default=1.0)
    p.add_argument("--top-k", type=int_at_least(0, " (0 = off)"), default=0)
    p.add_argument("--min-p", type=min_p_arg, default=0.0,
                   help="drop tokens less probable than MIN_P x the likeliest one (vLLM's min_p; 0 = off)")
    p.add_argument("--min-tokens", type=int_at_least(0), default=0,
                   help="no stop (end of sequence, --stop) before this many tokens (vLLM's min_tokens)")
    p.add_argument("--seed", type=seed_arg, default=None,
                   help="sampling seed: the same seed gives the same text (default: a random one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--bad-word", action="append", default=[], metavar="WORD",
                   help="a word the output never completes, as written or after a space (vLLM's bad_words; "
                        "repeatable)")


def _sampling_params(args, tokenizer):
    from flashdraft.engine import SamplingParams
    from flashdraft.engine.detokenize import bad_word_ids

    stop_ids = ()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop_ids = (int(tokenizer.eos_token_id),)
    bad_words = bad_word_ids(tokenizer, args.bad_word) if args.bad_word and tokenizer is not None else ()
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, min_tokens=args.min_tokens, seed=args.seed,
                          stop_token_ids=stop_ids, stop_strings=tuple(args.stop), bad_words=bad_words)


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    return ids


def run_generate(args) -> int:
    from flashdraft.engine import SamplingParams

    apply_threads(args)
    target, tokenizer, drafter = load_models(args)
    if tokenizer is None:
        print("error: the target has no tokenizer; use the Python API with token ids", file=sys.stderr)
        return 2
    params = replace(_sampling_params(args, tokenizer), logprobs=args.logprobs,
                     structured=structured_output_from_args(args))
    prompt_ids = _encode(tokenizer, args.prompt, args.chat)
    engine = engine_from_args(args, target, drafter, tokenizer)
    baseline_engine = engine_from_args(args, target, drafter, tokenizer, plain=True) if args.compare else None
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
    if result.logprobs is not None:
        report["logprobs"] = [{"token": e.token, "text": tokenizer.decode([e.token]), "logprob": e.logprob,
                               "top": [{"token": t, "text": tokenizer.decode([t]), "logprob": lp} for t, lp in e.top]}
                              for e in result.logprobs]
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
            check = compare_with_target(target, prompt_ids, params, result, engine.grammars
                                        if params.structured else None)
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
    for entry in report.get("logprobs", ()):
        others = ", ".join(f"{t['text']!r} {t['logprob']:.3f}" for t in entry["top"])
        print(f"{entry['text']!r:>16} {entry['logprob']:8.3f}" + (f"   top: {others}" if others else ""))
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
    add_structured_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--no-draft", action="store_true", help="plain decoding (no drafter); with --target")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding through the same engine (speedup) and, greedy, the target's own "
                        "transformers generate (equality check; exit 1 when they differ)")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")
    g.add_argument("--logprobs", type=int_in(0, MAX_LOGPROBS), default=None, metavar="N",
                   help="print each output token's log-probability under the target, with the N most likely tokens "
                        f"at its position (0-{MAX_LOGPROBS})")
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


def main(argv: list[str] | None = None) -> int:
    args, code = parse_args(build_parser(), argv)
    return code if args is None else run_command(args)


if __name__ == "__main__":
    sys.exit(main())
