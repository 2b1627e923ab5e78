"""The server's load sequence in one process: ONE drafting engine and one plain-decoding engine, each with ONE live
batch for its whole life (as `flashdraft serve` keeps one), warmed up for the largest level, then the levels in
order (1, 4, 16, ... as `serve_sweep.py` runs them), two interleaved rounds of the 32 held-out prompts each.
Per level: the ratio, per round the drafting engine's cycles (how many drafted, one-token cycles' time by rows and
by cycles since the last drafting cycle), both engines' step times by rows, and the goodput check's windows.

    python docs/bench/served_load_s42/levels.py [LEVELS=1,4,16,32,64] [TEMPERATURE=0] [SETS=default]
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402

from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.engine.policy import rate  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402

torch.set_num_threads(1)
levels = [int(x) for x in sys.argv[1].split(',')] if len(sys.argv) > 1 else [1, 4, 16, 32, 64]
T = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
sets = sys.argv[3].split(',') if len(sys.argv) > 3 else ['default']
target, tok, drafter = load_pair(None, None, 'cpu')
prompts = [tok.encode(q.text) for spec in sets for q in load_prompts(spec, 32 // len(sets))]
engines = {'plain': SpecEngine(target, None, tok), 'dflash': SpecEngine(target, drafter, tok)}
for e in engines.values():
    e.warmup(max(levels))
batches = {k: e.open_batch() for k, e in engines.items()}
cycles, steps = [], []  # the drafting engine's observed cycles; the current round's steps


def record_cycles(batch):
    observe = batch.policy.observe

    def recorded(rows, widths, accepted, timing):
        cycles.append((len(rows), list(widths), list(accepted), None if timing is None else timing.total_s))
        return observe(rows, widths, accepted, timing)
    batch.policy.observe = recorded


record_cycles(batches['dflash'])


@torch.inference_mode()
def serve(engine, batch, concurrency):
    """Requests join as the server admits them (all waiting at a cycle boundary, in one `step`)."""
    queue, n = list(enumerate(prompts)), 0
    steps.clear()
    started = time.perf_counter()
    while queue or batch.rows:
        joining = [queue.pop(0) for _ in range(min(len(queue), concurrency - len(batch.rows)))]
        params = [SamplingParams(max_new_tokens=64, temperature=T, seed=i if T > 0 else None) for i, _ in joining]
        t = time.perf_counter()
        events = (engine.step(batch, [p for _, p in joining], params, request_ids=[i for i, _ in joining])
                  if joining else engine.step(batch))
        steps.append((bool(joining), len(batch.rows), time.perf_counter() - t))
        n += sum(len(e.result.token_ids) for e in events if e.finished)
    return n, time.perf_counter() - started


def ms_by(groups):
    return ', '.join(f'{k}: {len(v)}x {statistics.median(v) * 1e3:.2f}' for k, v in sorted(groups.items())
                     if len(v) >= 3)


for concurrency in levels:
    total = {k: [0, 0.0] for k in engines}
    for r in range(2):
        for k in (engines if r % 2 == 0 else list(engines)[::-1]):
            start = len(cycles)
            n, s = serve(engines[k], batches[k], concurrency)
            total[k][0] += n
            total[k][1] += s
            by_rows = {}
            for joined, rows, seconds in steps:
                if not joined:
                    by_rows.setdefault(rows, []).append(seconds)
            print(f'  {k} round {r}: step ms by rows {ms_by(by_rows)}')
            if k == 'dflash':
                part = cycles[start:]
                drafting = [c for c in part if max(c[1]) > 1]
                since, after = 99, {}
                for c in part:
                    since = 0 if max(c[1]) > 1 else since + 1
                    if since and c[3] is not None:
                        after.setdefault((c[0], min(since, 6)), []).append(c[3])
                tokens = sum(c[0] + sum(c[2]) for c in drafting)
                print(f'  dflash round {r}: {len(drafting)} of {len(part)} cycles drafted, '
                      f'{tokens / max(1, len(drafting)):.1f} tokens per drafting cycle; one-token cycles, ms by '
                      f'(rows, cycles since drafting, 6 = 6 or more): {ms_by(after)}')
    ratio = (total['dflash'][0] / total['dflash'][1]) / (total['plain'][0] / total['plain'][1])
    print(f'conc {concurrency}: DFlash / plain decoding {ratio:.3f}', flush=True)
    g = engines['dflash'].costs.goodput
    for key in sorted(set(g.drafting) | set(g.plain)):
        d, p = g.drafting.get(key, ()), g.plain.get(key, ())
        print(f'  goodput check, rows bucket {key}: drafting {len(d)} cycles {rate(d) * 1e-3 if d else 0:.3f} tok/ms, '
              f'one-token {len(p)} cycles {rate(p) * 1e-3 if p else 0:.3f} tok/ms, last judged lost: {g.lost.get(key)}')
