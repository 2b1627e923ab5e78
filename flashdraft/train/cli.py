"""Command-line entry points for the training pipeline: `regenerate` and `train` subcommands.

`add_regenerate_parser(subparsers)` / `add_train_parser(subparsers)` register the subcommands on an argparse
subparsers object (each sets `func=` to its runner), so the package CLI (`flashdraft.cli`) can mount them;
`python -m flashdraft.train.cli regenerate|train ...` works on its own. Both run under torchrun (shards / DDP).

What this module does not know about: anything beyond argument parsing; the work is in regenerate.py/trainer.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from flashdraft.args import (ArgumentParser, add_structured_args, data_source_arg, device_arg, finite_float_in,
                             float_in, int_at_least, model_path_arg, output_dir_arg, parse_args, positive_int,
                             run_command, seed_arg, structured_output_from_args, temperature_arg, top_p_arg)


def _int_list(text: str) -> list[int]:
    try:
        numbers = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None
    if not numbers or min(numbers) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices >= 0, got {text!r}")
    return numbers


def _layer_types(text: str) -> list[str]:
    names = {"full": "full_attention", "sliding": "sliding_attention", "full_attention": "full_attention",
             "sliding_attention": "sliding_attention"}
    kinds = [k.strip() for k in text.split(",")]
    if not all(k in names for k in kinds):
        raise argparse.ArgumentTypeError(f"expected comma-separated full / sliding per draft layer, got {text!r}")
    return [names[k] for k in kinds]


def _new_or_dir(value: str) -> str:
    """--feature-cache: a directory (created when missing); an existing file is refused."""
    return output_dir_arg(value)


def add_regenerate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("regenerate", help="regenerate responses to prompts with the target itself",
                              description="Generate the target's own responses to prompts into sharded JSONL "
                                          "(shard-00000.jsonl ...), resumable; run under torchrun to split shards.")
    p.add_argument("--target", type=model_path_arg("target"), required=True, help="target model directory or hub id")
    p.add_argument("--data", type=data_source_arg, required=True,
                   help="prompts: JSONL file, directory of JSONL, or a datasets name")
    p.add_argument("--split", default="train")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N records")
    p.add_argument("--output-dir", type=output_dir_arg, required=True)
    p.add_argument("--shard-size", type=positive_int, default=1000)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--max-new-tokens", type=positive_int, default=1024)
    p.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=top_p_arg, default=1.0)
    p.add_argument("--top-k", type=int_at_least(0, " (0 = off)"), default=0)
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--max-prompt-length", type=positive_int, default=None, help="drop prompts longer than this")
    add_structured_args(p)  # answers under the grammar users will serve with: a drafter for that traffic
    p.add_argument("--device", type=device_arg, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_regenerate)
    return p


def run_regenerate(args) -> int:
    import os

    import torch

    from flashdraft.train.data import load_prompts
    from flashdraft.loading import load_target
    from flashdraft.train.regenerate import regenerate

    device = None if args.device == "auto" else args.device
    if device is None and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    model, tokenizer = load_target(args.target, device=device)
    prompts = load_prompts(args.data, tokenizer, split=args.split, limit=args.limit)
    if args.max_prompt_length:
        prompts = [p for p in prompts if len(p) <= args.max_prompt_length]
    paths = regenerate(model, prompts, args.output_dir, tokenizer=tokenizer, shard_size=args.shard_size,
                       batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, progress=not args.no_progress,
                       structured=structured_output_from_args(args))
    print(json.dumps({"shards": [str(p) for p in paths], "prompts": len(prompts)}))
    return 0


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a DFlash drafter for a target model",
                              description="Train a DFlash drafter (docs/design.md, 'Training'). Single process, or DDP "
                                          "with torchrun --nproc-per-node N (gloo on CPU, nccl on GPU).")
    p.add_argument("--target", type=model_path_arg("target"), required=True, help="target model directory or hub id")
    p.add_argument("--data", type=data_source_arg, required=True,
                   help="regenerated shards dir, JSONL, or a datasets name")
    p.add_argument("--output-dir", type=output_dir_arg, required=True)
    p.add_argument("--block-size", type=int_at_least(2, " (the bonus token plus at least one draft)"), default=16)
    p.add_argument("--num-draft-layers", type=positive_int, default=5)
    p.add_argument("--target-layer-ids", type=_int_list, default=None, help="e.g. '1,9,17,25,33' (default: evenly spaced)")
    p.add_argument("--num-taps", type=positive_int, default=None,
                   help="number of target layers tapped (default: draft layers)")
    p.add_argument("--mask-token-id", type=int_at_least(0), default=None,
                   help="default: the tokenizer's mask token (<|mask|>)")
    p.add_argument("--intermediate-size", type=positive_int, default=None)
    p.add_argument("--epochs", type=positive_int, default=6)
    p.add_argument("--max-steps", type=positive_int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences per micro-batch per process")
    p.add_argument("--grad-accum", type=positive_int, default=1)
    p.add_argument("--max-length", type=positive_int, default=3072)
    p.add_argument("--num-anchors", type=positive_int, default=512)
    p.add_argument("--start-anchors", type=int_at_least(0), default=0,
                   help="the first N blocks of every answer are always among its anchors (short answers spend "
                        "many of their drafts there); the rest are drawn uniformly (default 0: all uniform)")
    p.add_argument("--lr", type=finite_float_in(0.0), default=6e-4)
    p.add_argument("--selector-lr", type=finite_float_in(0.0), default=None,
                   help="--arch dflash2: the candidate selector's learning rate (default: --lr); a fresh selector "
                        "grown on a trained drafter (--init-from) learns at a fine-tuning --lr too slowly")
    p.add_argument("--weight-decay", type=finite_float_in(0.0), default=0.0)
    p.add_argument("--warmup-ratio", type=float_in(0.0, 1.0), default=0.04)
    p.add_argument("--grad-clip", type=finite_float_in(0.0, low_open=True), default=1.0)
    p.add_argument("--gamma", type=finite_float_in(0.0, low_open=True), default=None,
                   help="loss decay (default 7/5/4 for B=16/10/8)")
    p.add_argument("--distill-weight", type=float_in(0.0, 1.0), default=0.0, help="soft-label KL weight in [0, 1]")
    p.add_argument("--selector-distill-weight", type=float_in(0.0, 1.0), default=0.0,
                   help="--arch dflash2: the selector's soft-label KL weight in [0, 1] (the target's distribution "
                        "given the true prefix, over the candidates)")
    p.add_argument("--distill-temperature", type=finite_float_in(0.0, low_open=True), default=1.0)
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="auto")
    p.add_argument("--feature-cache", type=_new_or_dir, default=None,
                   help="directory for offline target features (safetensors)")
    p.add_argument("--save-every", type=positive_int, default=500)
    p.add_argument("--keep-checkpoints", type=positive_int, default=2)
    p.add_argument("--eval-prompts", type=data_source_arg, default=None,
                   help="held-out prompts (JSONL/datasets) for tau evaluation")
    p.add_argument("--eval-limit", type=positive_int, default=64)
    p.add_argument("--eval-every", type=int_at_least(0, " (0 = only at the start and the end)"), default=0)
    p.add_argument("--eval-max-new-tokens", type=positive_int, default=64)
    p.add_argument("--no-eval-at-start", action="store_true")
    p.add_argument("--log-every", type=positive_int, default=1)
    p.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in --output-dir")
    p.add_argument("--device", type=device_arg, default=None)
    p.add_argument("--export-dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--draft-vocab-size", type=positive_int, default=None,
                   help="read out over the N most frequent response tokens only (own lm_head + d2t, as EAGLE-3 and "
                        "vLLM store it); default: the target's whole vocabulary")
    p.add_argument("--init-from", type=model_path_arg("drafter"), default=None,
                   help="start from this drafter's weights (all but the read-out) instead of random ones; with "
                        "--arch dflash2 a DFlash-1 drafter works too (identity convolutions, a fresh selector); one "
                        "with fewer layers than --num-draft-layers grows (the added layers start as the identity)")
    p.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="dflash2: grouped dynamic convolutions around each layer's attention and MLP and a candidate "
                        "selector (z-lab's DFlash2DraftModel layout); default dflash")
    for flag, what in (("selector-rank", "rank of the selector's pair score"), ("selector-top-k", "candidates per "
                       "position"), ("conv-kernel-size", "convolution taps"), ("conv-group-size", "channels sharing "
                       "one dynamic weight; divides the hidden size")):
        p.add_argument(f"--{flag}", type=positive_int, default=None, help=f"--arch dflash2: {what} (default: ours, "
                       "flashdraft/model/dflash2.py DEFAULT_DFLASH2)")
    p.add_argument("--pack-sequences", action="store_true",
                   help="put several examples back to back in rows of up to --max-length tokens (attention never "
                        "crosses examples); for data of many short examples")
    p.add_argument("--layer-types", type=_layer_types, default=None,
                   help="per draft layer, comma-separated: full (full_attention) or sliding (sliding_attention); "
                        "default all full")
    p.add_argument("--sliding-window", type=positive_int, default=None,
                   help="window of the sliding_attention layers (positions a query sees, itself included)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="under torchrun: split the drafter's AdamW moments over the processes (ZeRO-1)")
    p.add_argument("--shard-target", action="store_true",
                   help="under torchrun: shard the frozen target's decoder layers over the processes (FSDP2) "
                        "instead of holding it whole in each; the drafter stays data-parallel")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_train)
    return p


def config_from_args(args):
    from flashdraft.train.trainer import TrainConfig

    return TrainConfig(
        target=args.target, data=args.data, output_dir=args.output_dir, block_size=args.block_size,
        num_draft_layers=args.num_draft_layers, target_layer_ids=args.target_layer_ids, num_taps=args.num_taps,
        mask_token_id=args.mask_token_id, intermediate_size=args.intermediate_size, epochs=args.epochs,
        max_steps=args.max_steps, batch_size=args.batch_size, grad_accum=args.grad_accum, max_length=args.max_length,
        num_anchors=args.num_anchors, start_anchors=args.start_anchors, lr=args.lr, selector_lr=args.selector_lr,
        weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio,
        grad_clip=args.grad_clip, gamma=args.gamma, distill_weight=args.distill_weight,
        selector_distill_weight=args.selector_distill_weight,
        distill_temperature=args.distill_temperature, seed=args.seed, attention=args.attention,
        feature_cache=args.feature_cache, save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
        eval_prompts=args.eval_prompts, eval_limit=args.eval_limit, eval_every=args.eval_every,
        eval_at_start=not args.no_eval_at_start, eval_max_new_tokens=args.eval_max_new_tokens,
        log_every=args.log_every, resume=args.resume, device=None if args.device == "auto" else args.device,
        export_dtype=args.export_dtype, shard_target=args.shard_target,
        shard_optimizer=args.shard_optimizer, pack_sequences=args.pack_sequences,
        layer_types=args.layer_types, sliding_window=args.sliding_window, draft_vocab_size=args.draft_vocab_size,
        init_from=args.init_from, arch=args.arch, selector_rank=args.selector_rank,
        selector_top_k=args.selector_top_k, conv_kernel_size=args.conv_kernel_size,
        conv_group_size=args.conv_group_size,
        progress=not args.no_progress,
    )


def run_train(args) -> int:
    from flashdraft.train.trainer import NonFiniteLoss, Trainer

    trainer = Trainer(config_from_args(args))
    result = None
    try:
        result = trainer.train()
    except NonFiniteLoss as exc:  # a failed run, not a usage error: one line, exit 1
        if trainer.rank == 0:
            print(f"flashdraft train: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    finally:
        trainer.close(finished=result is not None)
    if trainer.rank == 0:
        print(json.dumps({"steps": result.steps, "final_dir": result.final_dir, "log": result.log_path,
                          "tau_start": (result.eval_start or {}).get("tau"), "tau_end": (result.eval_end or {}).get("tau"),
                          "tokens_per_second": round(result.tokens_per_second, 1),
                          "final_loss": result.losses[-1] if result.losses else None}))
    return 0


def main(argv: list[str] | None = None, one_line_errors: bool = False) -> int:
    """Bad flags: one line on stderr and exit 2 (argparse), like `flashdraft train|regenerate`. User errors found
    later (missing files, no intact checkpoint ...) raise ValueError, or with `one_line_errors` (the command line)
    print one line and exit 2, via `run_command`."""
    parser = ArgumentParser(prog="python -m flashdraft.train.cli", description="DFlash drafter training")
    sub = parser.add_subparsers(dest="command", required=True)
    add_regenerate_parser(sub)
    add_train_parser(sub)
    args, code = parse_args(parser, argv)
    if args is None:
        return code
    return run_command(args, prog=f"flashdraft {args.command}") if one_line_errors else args.func(args)


if __name__ == "__main__":
    sys.exit(main(one_line_errors=True))
