"""KV-cache projection for real model shapes: bytes per position and rows that fit a budget at given lengths.

    python scripts/memory/project.py                       # Qwen3-8B, Llama-3.1-70B, gpt-oss-20b: the default table
    python scripts/memory/project.py --model Qwen3-8B --budget-gib 40 --length 1024:512 --length 7168:1024

Targets are built from their config only (flashdraft.memory.REAL_SHAPES, no weights, no hub access), with a
5-layer drafter of the same attention shape (`make_draft_config`), in bf16. A length is PROMPT:MAX_TOKENS;
MAX_TOKENS `rest` is what a chat request without max_tokens may run to (the rest of the context, here --context).
Rows are counted at their end (prompt + max_tokens held) with the engine's own rule (flashdraft.memory.rows_that_fit:
each row owns pages of --kv-page-size positions for what it holds), the figure `flashdraft serve` logs at start-up;
in parentheses, the rows the engine fitted before caches grew (a power of two of at least 256 positions reserved
per row up front). A model with sliding-window layers (gpt-oss-20b) counts their positions at their share of a
position's bytes, as many as their window reaches (`flashdraft.memory.kv_shares`); after the slash, the rows if those
layers kept every position, as before they gave pages back.
Rows that have not reached their end hold less, so the server runs more of them and preempts when they outgrow
the budget. The weights are counted on the meta device, so budgets can be read against a GPU: KV budget = GPU
memory - weights - activations.
"""

from __future__ import annotations

import argparse

import torch

from flashdraft.engine.batch import next_power_of_two
from flashdraft.memory import (FULL_ATTENTION, GiB, REAL_SHAPES, kv_bytes_per_position, real_config, row_positions,
                               rows_that_fit, window_shares)
from flashdraft.model.drafter import make_draft_config
from flashdraft.model.fast_target import layer_windows


def parse_length(text: str) -> tuple[int, str]:
    prompt, _, new = text.partition(":")
    if not prompt.isdigit() or not (new.isdigit() or new == "rest"):
        raise argparse.ArgumentTypeError(f"expected PROMPT:MAX_TOKENS (MAX_TOKENS a number or 'rest'), got {text!r}")
    return int(prompt), new


def weight_bytes(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(REAL_SHAPES), action="append", default=None)
    p.add_argument("--budget-gib", type=float, action="append", default=None, help="KV budgets (default 20 and 60)")
    p.add_argument("--length", type=parse_length, action="append", default=None,
                   help="PROMPT:MAX_TOKENS (default 512:512, 2048:1024, 512:rest, 4096:rest)")
    p.add_argument("--context", type=int, default=8192, help="context a chat request's max_tokens defaults to")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-page-size", type=int, default=64, help="positions per page of the engine's caches")
    p.add_argument("--draft-layers", type=int, default=5)
    args = p.parse_args(argv)
    budgets = args.budget_gib or [20.0, 60.0]
    lengths = args.length or [(512, "512"), (2048, "1024"), (512, "rest"), (4096, "rest")]
    for name in args.model or sorted(REAL_SHAPES):
        config = real_config(name)
        drafter = make_draft_config(config, num_layers=args.draft_layers, block_size=args.block_size, mask_token_id=0)
        t_bytes = kv_bytes_per_position(config, torch.bfloat16)
        d_bytes = kv_bytes_per_position(drafter, torch.bfloat16)
        shares = window_shares(layer_windows(config, config.num_hidden_layers), t_bytes, d_bytes)
        print(f"\n{name}: weights {weight_bytes(config) / GiB:.1f} GiB (bf16); K/V per position: target "
              f"{t_bytes / 1024:.0f} KiB, {args.draft_layers}-layer drafter {d_bytes / 1024:.0f} KiB")
        print("| prompt | max_tokens | positions / row at its end | GiB / row | "
              + " | ".join(f"rows in {b:g} GiB (before)" for b in budgets) + " |")
        print("|---:|---:|---:|---:|" + "---:|" * len(budgets))
        for prompt, new in lengths:
            max_new = args.context - prompt if new == "rest" else int(new)
            tokens = prompt + max_new
            capacity = round(row_positions(tokens, args.block_size, args.kv_page_size, shares))
            per_row = capacity * (t_bytes + d_bytes) / GiB
            reserved_before = max(256, next_power_of_two(tokens + args.block_size)) + 1
            fits = []
            for b in budgets:
                rows = [rows_that_fit(int(b * GiB), tokens, args.block_size, args.kv_page_size, t_bytes, d_bytes, s)
                        for s in dict.fromkeys((shares, FULL_ATTENTION))]
                fits.append(" / ".join(map(str, rows)) + f" ({int(b * GiB // (reserved_before * (t_bytes + d_bytes)))})")
            shown = f"{max_new} (rest of {args.context})" if new == "rest" else str(max_new)
            print(f"| {prompt} | {shown} | {capacity} | {per_row:.2f} | " + " | ".join(map(str, fits)) + " |")


if __name__ == "__main__":
    main()
