"""Sliding-window layers giving back the pages their window has left (`slots.GroupedKV`, `PagedKV.reserve(keep_from=)`)
against keeping every position (the code before, restored in the same process: one `PagedKV` for all layers, no
window), kept as run. The models of `window_reads.py` (the shipped target's shape, 128-token windows, fp32), prompts
of `--contexts` tokens, plain decoding of `--new` tokens a row, one thread, the two ways interleaved over rounds.
Per way: the K/V bytes the target's cache rows own at the end (`PagedKV.pool_bytes(held_only=True)`, the trash pages
included), the pools' bytes (free pages included), decoding tokens/s after the prefill; both ways must give the
same tokens.

    python docs/bench/window_reads/window_pages.py [--rounds 3] [--batch 1,4] [--contexts 1024,4096] [--new 48]
"""
import argparse, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_reads import FAMILIES  # noqa: E402
from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.model import fast_target  # noqa: E402
from flashdraft.model.slots import PagedKV  # noqa: E402

NEW_PAGED_CACHE = fast_target.new_paged_cache


def every_position(windows, batch, *args, **kwargs):
    return PagedKV(len(windows), batch, *args, **kwargs)


def run(engine, prompts, tokens, keep_all: bool) -> tuple[float, int, int, int, list]:
    """(decoding seconds after the first streamed tokens, tokens decoded in them, owned bytes at the end, pool
    bytes at the end, every row's tokens)."""
    fast_target.new_paged_cache = every_position if keep_all else NEW_PAGED_CACHE
    owned = pool = 0
    try:
        batch = engine.open_batch()
        outputs = [[] for _ in prompts]
        for event in engine.add(batch, prompts, SamplingParams(max_new_tokens=tokens)):
            outputs[event.index].extend(event.token_ids)
        first, produced = time.perf_counter(), 0
        while batch.rows:
            kv = batch.kv.kv
            owned, pool = kv.pool_bytes(held_only=True), kv.pool_bytes()
            for event in engine.step(batch):
                outputs[event.index].extend(event.token_ids)
                produced += len(event.token_ids)
        return time.perf_counter() - first, produced, owned, pool, outputs
    finally:
        fast_target.new_paged_cache = NEW_PAGED_CACHE


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"plain decoding, {args.new} new tokens a row; K/V the rows own at their end (MiB) and decoding tokens/s "
          f"after the prefill, median of {args.rounds} rounds\n")
    print("| family | context | batch | owned: window pages | every position | ratio | pools | tokens/s: window "
          "pages | every position | ratio | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        what, cls, config = FAMILIES[family]
        torch.manual_seed(0)
        model = cls(config()).float().eval()
        engine = SpecEngine(model)
        assert engine.fast is not None
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batch.split(",")):
                prompts = [torch.randint(0, 8000, (context,), generator=torch.Generator().manual_seed(r)).tolist()
                           for r in range(batch)]
                speed, held, outputs = {False: [], True: []}, {}, {}
                for r in range(args.rounds + 1):  # the first round warms up, untimed
                    for keep_all in ((False, True) if r % 2 else (True, False)):
                        seconds, produced, owned, pool, outputs[keep_all] = run(engine, prompts, args.new, keep_all)
                        held[keep_all] = (owned, pool)
                        if r:
                            speed[keep_all].append(produced / seconds)
                ours, before = statistics.median(speed[False]), statistics.median(speed[True])
                mib = {k: (o / 2**20, p / 2**20) for k, (o, p) in held.items()}
                print(f"| {family} ({what}) | {context} | {batch} | {mib[False][0]:.2f} | {mib[True][0]:.2f} | "
                      f"**{mib[False][0] / mib[True][0]:.2f}x** | {mib[False][1]:.2f} / {mib[True][1]:.2f} | "
                      f"{ours:.1f} | {before:.1f} | {ours / before:.2f}x | {outputs[False] == outputs[True]} |",
                      flush=True)


if __name__ == "__main__":
    main()
