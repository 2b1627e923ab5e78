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


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def add_regenerate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("regenerate", help="regenerate responses to prompts with the target itself",
                              description="Generate the target's own responses to prompts into sharded JSONL "
                                          "(shard-00000.jsonl ...), resumable; run under torchrun to split shards.")
    p.add_argument("--target", required=True, help="target model directory or hub id")
    p.add_argument("--data", required=True, help="prompts: JSONL file, directory of JSONL, or a datasets name")
    p.add_argument("--split", default="train")
    p.add_argument("--limit", type=int, default=None, help="use only the first N records")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-length", type=int, default=None, help="drop prompts longer than this")
    p.add_argument("--device", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_regenerate)
    return p


def run_regenerate(args) -> int:
    import os

    import torch

    from flashdraft.train.data import load_prompts
    from flashdraft.loading import load_target
    from flashdraft.train.regenerate import regenerate

    device = args.device
    if device is None and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    model, tokenizer = load_target(args.target, device=device)
    prompts = load_prompts(args.data, tokenizer, split=args.split, limit=args.limit)
    if args.max_prompt_length:
        prompts = [p for p in prompts if len(p) <= args.max_prompt_length]
    paths = regenerate(model, prompts, args.output_dir, tokenizer=tokenizer, shard_size=args.shard_size,
                       batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, progress=not args.no_progress)
    print(json.dumps({"shards": [str(p) for p in paths], "prompts": len(prompts)}))
    return 0


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a DFlash drafter for a target model",
                              description="Train a DFlash drafter (docs/design.md, 'Training'). Single process, or DDP "
                                          "with torchrun --nproc-per-node N (gloo on CPU, nccl on GPU).")
    p.add_argument("--target", required=True, help="target model directory or hub id")
    p.add_argument("--data", required=True, help="regenerated shards dir, JSONL, or a datasets name")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-draft-layers", type=int, default=5)
    p.add_argument("--target-layer-ids", type=_int_list, default=None, help="e.g. '1,9,17,25,33' (default: evenly spaced)")
    p.add_argument("--num-taps", type=int, default=None, help="number of target layers tapped (default: draft layers)")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask token (<|mask|>)")
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch per process")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--num-anchors", type=int, default=512)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=None, help="loss decay (default 7/5/4 for B=16/10/8)")
    p.add_argument("--distill-weight", type=float, default=0.0, help="soft-label KL weight in [0, 1]")
    p.add_argument("--distill-temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="auto")
    p.add_argument("--feature-cache", default=None, help="directory for offline target features (safetensors)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--eval-prompts", default=None, help="held-out prompts (JSONL/datasets) for tau evaluation")
    p.add_argument("--eval-limit", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--no-eval-at-start", action="store_true")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    p.add_argument("--device", default=None)
    p.add_argument("--export-dtype", choices=["float32", "bfloat16", "float16"], default=None)
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
        num_anchors=args.num_anchors, lr=args.lr, weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio,
        grad_clip=args.grad_clip, gamma=args.gamma, distill_weight=args.distill_weight,
        distill_temperature=args.distill_temperature, seed=args.seed, attention=args.attention,
        feature_cache=args.feature_cache, save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
        eval_prompts=args.eval_prompts, eval_limit=args.eval_limit, eval_every=args.eval_every,
        eval_at_start=not args.no_eval_at_start, eval_max_new_tokens=args.eval_max_new_tokens,
        log_every=args.log_every, resume=args.resume, device=args.device, export_dtype=args.export_dtype,
        progress=not args.no_progress,
    )


def run_train(args) -> int:
    from flashdraft.train.trainer import Trainer

    trainer = Trainer(config_from_args(args))
    result = trainer.train()
    if trainer.rank == 0:
        print(json.dumps({"steps": result.steps, "final_dir": result.final_dir, "log": result.log_path,
                          "tau_start": (result.eval_start or {}).get("tau"), "tau_end": (result.eval_end or {}).get("tau"),
                          "tokens_per_second": round(result.tokens_per_second, 1),
                          "final_loss": result.losses[-1] if result.losses else None}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashdraft.train.cli", description="DFlash drafter training")
    sub = parser.add_subparsers(dest="command", required=True)
    add_regenerate_parser(sub)
    add_train_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
