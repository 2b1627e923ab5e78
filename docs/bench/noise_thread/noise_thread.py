"""Sampled steps with the noise made inline against on a thread of its own (`EngineConfig.noise_thread`), in one
process: steady batches of ROWS held-out requests at temperature T, passes alternating, median ms per step.

    python docs/bench/noise_thread/noise_thread.py [--rows 1,16,64] [--steps 40] [--passes 6] [--temperature 1]
                                                   [--engines plain,dflash] [--threads 1]

Engines: plain decoding (no drafter) and DFlash under the default policy, each built twice (noise inline, noise
thread). A batch is filled, stepped 4 times to settle, then STEPS timed steps; every pass runs each engine once,
the order reversed every other pass. Each pass checks that both builds committed the same tokens (the noise is the
same function of seed and position, so seeded text does not depend on where it is made).

What this script does not know about: HTTP, joins and drains (`scripts/speed/engine_concurrency.py`), other
machines' cores (with as many torch threads as cores, the default leaves the thread off).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402


def timed_pass(engine: SpecEngine, prompts, steps: int, temperature: float) -> tuple[float, list[list[int]]]:
    """Median seconds per step of a steady batch, and the tokens each row committed."""
    batch = engine.open_batch()
    params = [SamplingParams(max_new_tokens=steps * 17 + 64, temperature=temperature, seed=i)
              for i in range(len(prompts))]
    events = list(engine.add(batch, prompts, params))
    for _ in range(4):
        events += engine.step(batch)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        events += engine.step(batch)
        times.append(time.perf_counter() - t)
    tokens = {}
    for e in events:
        tokens.setdefault(e.index, []).extend(e.token_ids)
    return statistics.median(times), [tokens[i] for i in sorted(tokens)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--engines", default="plain,dflash")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(None, None, "cpu", None)
    for rows in [int(r) for r in args.rows.split(",")]:
        prompts = [tokenizer.encode(q.text) for q in load_prompts("default", rows)]
        for kind in args.engines.split(","):
            engines = {on: SpecEngine(target, drafter if kind == "dflash" else None, tokenizer, noise_thread=on)
                       for on in (False, True)}
            for e in engines.values():
                e.warmup(rows)
            ms = {False: [], True: []}
            for k in range(args.passes):
                texts = {}
                for on in ((False, True) if k % 2 == 0 else (True, False)):
                    step_s, texts[on] = timed_pass(engines[on], prompts, args.steps, args.temperature)
                    ms[on].append(1000 * step_s)
                n = min(len(a) for a in texts[False] + texts[True])
                if [a[:n] for a in texts[False]] != [a[:n] for a in texts[True]]:
                    raise SystemExit(f"{kind} at {rows} rows: the two builds committed different tokens")
            inline, thread = statistics.median(ms[False]), statistics.median(ms[True])
            print(f"{kind:6s} rows {rows:3d} T={args.temperature:g}: inline {inline:7.3f} ms/step, thread "
                  f"{thread:7.3f} ms/step, {inline / thread:.3f}x  (passes inline "
                  f"{' '.join(f'{x:.2f}' for x in ms[False])}; thread {' '.join(f'{x:.2f}' for x in ms[True])})",
                  flush=True)
            for e in engines.values():
                e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
