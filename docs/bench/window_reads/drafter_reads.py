"""A sliding-window drafter's draft step reading only its window against reading its whole context (kept as run):
the shipped drafter's shape (2 layers, hidden 256, bf16 weights drafted in fp32 on CPU as the engine does) with every
layer sliding over `--window` slots, random weights, a paged context of `--contexts` positions, one block of 16 per
row; `DFlashDraftModel.draft` timed with its windowed reads and with `_window_starts` patched to read from slot 0,
interleaved, one thread. Also checks the two give the same hidden states (fp32, 1e-5).

    python docs/bench/window_reads/drafter_reads.py [--contexts 1024,4096] [--batch 1,4] [--window 256] [--iters 100]
"""
import argparse, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from flashdraft.loading import load_pair  # noqa: E402
from flashdraft.model.drafter import DFlashDraftModel, make_draft_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, _, shipped = load_pair()
    config = make_draft_config(target.config, num_layers=2, block_size=16, mask_token_id=shipped.mask_token_id,
                               layer_types=["sliding_attention"] * 2, sliding_window=args.window,
                               target_layer_ids=shipped.target_layer_ids)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(config).eval()
    windowed = DFlashDraftModel._window_starts
    whole = lambda self, position_ids, cache: {None: 0, args.window: 0}  # noqa: E731
    width = len(drafter.target_layer_ids) * drafter.target_hidden_size
    print(f"| context | batch | window reads ms | whole reads ms | ratio |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for context in map(int, args.contexts.split(",")):
            for b in map(int, args.batch.split(",")):
                cache = drafter.new_cache(b, context + 16)
                positions = torch.arange(context)[None].expand(b, -1)
                drafter.write_context(cache, torch.randn(b, context, width), positions,
                                      torch.ones(b, context, dtype=torch.bool))
                embeds = torch.randn(b, 16, config.hidden_size)
                block = torch.arange(context, context + 16)[None].expand(b, -1)
                times, outs = {"window": [], "whole": []}, {}
                for i in range(args.iters + 5):
                    for name, starts in (("window", windowed), ("whole", whole))[::1 if i % 2 else -1]:
                        DFlashDraftModel._window_starts = starts
                        start = time.perf_counter()
                        outs[name] = drafter.draft(cache, embeds, block, context)
                        if i >= 5:
                            times[name].append(time.perf_counter() - start)
                DFlashDraftModel._window_starts = windowed
                torch.testing.assert_close(outs["window"], outs["whole"], rtol=1e-5, atol=1e-5)
                ours, before = (1e3 * statistics.median(times[k]) for k in ("window", "whole"))
                print(f"| {context} | {b} | {ours:.2f} | {before:.2f} | **{before / ours:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
