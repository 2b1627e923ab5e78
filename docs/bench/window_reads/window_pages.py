"""Sliding-window layers giving back the pages their window has left (`slots.GroupedKV`, `PagedKV.reserve(keep_from=)`)
against keeping every position (the code before, restored in the same process: one `PagedKV` for all layers, no
window), kept as run. The models of `window_reads.py` (the shipped target's shape, 128-token windows, fp32), prompts
of `--contexts` tokens, plain decoding, one thread. Both ways decode the same prompts side by side in two live
batches, in alternating blocks of `--steps` steps (`--rounds` each, after 8 untimed steps), and report the K/V bytes
the target's cache rows own at the end (`pool_bytes(held_only=True)`, the trash pages included), the pools' bytes
(free pages included), the median milliseconds per step; both ways must give the same tokens.

    python docs/bench/window_reads/window_pages.py [--rounds 6] [--steps 32] [--batch 1,4] [--contexts 1024,4096]
"""
import argparse, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_reads import FAMILIES, random_model, random_prompts  # noqa: E402
from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.model import fast_target  # noqa: E402
from flashdraft.model.slots import PagedKV  # noqa: E402

NEW_PAGED_CACHE = fast_target.new_paged_cache


def every_position(windows, batch, *args, **kwargs):
    return PagedKV(len(windows), batch, *args, **kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    new = 8 + args.rounds * args.steps
    print(f"plain decoding of {new} tokens a row; K/V the rows own at the end (MiB), pools (MiB), median ms per step "
          f"over {args.rounds} alternating blocks of {args.steps} steps\n")
    print("| family | context | batch | owned: window pages | every position | ratio | pools | ms / step: window "
          "pages | every position | speed ratio | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        what, model = random_model(family)
        engine = SpecEngine(model)
        assert engine.fast is not None
        for context in map(int, args.contexts.split(",")):
            for batch_size in map(int, args.batch.split(",")):
                prompts = random_prompts(batch_size, context)
                batches, outputs, times = {}, {}, {False: [], True: []}

                def steps(keep_all: bool, n: int) -> None:
                    for _ in range(n):
                        for event in engine.step(batches[keep_all]):
                            outputs[keep_all][event.index].extend(event.token_ids)

                for keep_all in (False, True):
                    fast_target.new_paged_cache = every_position if keep_all else NEW_PAGED_CACHE
                    try:
                        batches[keep_all] = engine.open_batch()
                        outputs[keep_all] = [[] for _ in prompts]
                        for event in engine.add(batches[keep_all], prompts, SamplingParams(max_new_tokens=new + 2)):
                            outputs[keep_all][event.index].extend(event.token_ids)
                    finally:
                        fast_target.new_paged_cache = NEW_PAGED_CACHE
                    steps(keep_all, 8)
                for r in range(args.rounds):
                    for keep_all in ((False, True) if r % 2 else (True, False)):
                        started = time.perf_counter()
                        steps(keep_all, args.steps)
                        times[keep_all].append((time.perf_counter() - started) / args.steps * 1000)
                owned = {k: b.kv.kv.pool_bytes(held_only=True) / 2**20 for k, b in batches.items()}
                pools = {k: b.kv.kv.pool_bytes() / 2**20 for k, b in batches.items()}
                ours, before = statistics.median(times[False]), statistics.median(times[True])
                print(f"| {family} ({what}) | {context} | {batch_size} | {owned[False]:.2f} | {owned[True]:.2f} | "
                      f"**{owned[False] / owned[True]:.2f}x** | {pools[False]:.2f} / {pools[True]:.2f} | "
                      f"{ours:.2f} | {before:.2f} | {before / ours:.2f}x | {outputs[False] == outputs[True]} |",
                      flush=True)


if __name__ == "__main__":
    main()
