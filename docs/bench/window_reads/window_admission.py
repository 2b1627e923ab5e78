"""What a KV-cache memory budget (`flashdraft serve --kv-cache-memory`) admits when sliding-window layers give back
the pages their window has left, against the code before (every layer keeps every position, and admission counts
every layer's positions: `fast_target.new_paged_cache` and `scheduler.kv_shares` restored in the same process). The
server's scheduler in process (no HTTP), plain decoding, the models of `window_reads.py` (the shipped target's shape,
128-token windows, fp32), `--requests` prompts of `--prompt` tokens queued at once, `--new` tokens each, greedy,
a budget of `--rows` whole rows (prompt + max_tokens) under the old rule. Reports the most rows decoding at once,
the wall time to serve them all and the tokens per second; both must give the same texts.

    python docs/bench/window_reads/window_admission.py [--requests 16] [--prompt 1024] [--new 64] [--rows 4]
"""
import argparse, asyncio, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_reads import FAMILIES, random_model, random_prompts  # noqa: E402
from window_pages import NEW_PAGED_CACHE, every_position  # noqa: E402
from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.memory import FULL_ATTENTION, held_positions  # noqa: E402
from flashdraft.model import fast_target  # noqa: E402
from flashdraft.serve import scheduler  # noqa: E402

KV_SHARES = scheduler.kv_shares


def serve(model, prompts, new: int, budget: int, before: bool) -> tuple[int, float, list]:
    """(most rows in a cycle, seconds, every request's tokens)."""
    fast_target.new_paged_cache = every_position if before else NEW_PAGED_CACHE
    scheduler.kv_shares = (lambda engine: FULL_ATTENTION) if before else KV_SHARES
    engine = SpecEngine(model)
    most, step = [0], engine.step

    def counting(batch, *args, **kwargs):  # rows before the cycle, and after it (with those it let join)
        most[0] = max(most[0], len(batch.rows))
        out = step(batch, *args, **kwargs)
        most[0] = max(most[0], len(batch.rows))
        return out

    engine.step = counting
    sched = scheduler.Scheduler(engine, max_batch_size=len(prompts), max_queue=len(prompts), threads=1,
                                kv_cache_positions=budget)
    sched.start()

    async def main():
        with sched._cond:  # all queued before the first admission: the same order every run
            reqs = [sched.submit(p, SamplingParams(max_new_tokens=new), str(i)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect(r) for r in reqs))

    async def collect(req):
        tokens = []
        while True:
            item = await req.queue.get()
            tokens += item.token_ids
            if item.finished:
                return tokens

    started = time.perf_counter()
    try:
        outputs = asyncio.run(main())
    finally:
        sched.stop()
        fast_target.new_paged_cache, scheduler.kv_shares = NEW_PAGED_CACHE, KV_SHARES
    return most[0], time.perf_counter() - started, outputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="the budget: this many whole rows under the old rule")
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = random_prompts(args.requests, args.prompt)
    print(f"{args.requests} requests of {args.prompt} prompt tokens x {args.new}, greedy, plain decoding; a budget of "
          f"{args.rows} whole rows under the old rule\n")
    print("| family | budget (positions) | most rows at once: window pages | before | seconds: window pages | before "
          "| speed ratio | same texts |")
    print("|---|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        what, model = random_model(family)
        block = SpecEngine(model).scratch_slots
        budget = held_positions([args.prompt + args.new] * args.rows, block, 64)
        ours, before = (serve(model, prompts, args.new, budget, b) for b in (False, True))
        print(f"| {family} ({what}) | {budget} | **{ours[0]}** | {before[0]} | {ours[1]:.1f} | {before[1]:.1f} | "
              f"**{before[1] / ours[1]:.2f}x** | {ours[2] == before[2]} |", flush=True)


if __name__ == "__main__":
    main()
