"""Read a `flashdraft serve --cycle-trace` file written during `serve_sweep.py` and summarise it round by round
(a round: cycles with no gap over GAP seconds between them; the sweep's other servers run in the gaps): cycles,
the largest batch, the drafting cycles (rows, rows drafting, tokens committed, ms) against one-token cycles, and
the committed tokens per ms of each kind. With ROWS, also the cycles from the first one of more than ROWS rows on
(the sweep's next level; one-row cycles without joins left out: the client's warm-up request), by kind: drafting
or one-token, with requests joining in the cycle or not.

    python docs/bench/served_load_s42/trace_rounds.py TRACE.jsonl[.gz] [GAP=0.5] [ROWS]

The trace of BENCHMARKS.md's 'Served, cell by cell' is trace_heldout_t0_c1_4_16.jsonl.gz here (ROWS 4: its
16-request level).
"""
import gzip
import json
import statistics
import sys

with (gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt") as trace:
    records = [json.loads(line) for line in trace]
gap = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
rounds, current = [], []
for r in records:
    if current and r["time"] - current[-1]["time"] - r["ms"] / 1000 > gap:
        rounds.append(current)
        current = []
    current.append(r)
rounds.append(current)


def committed(r):
    return len(r["widths"]) + sum(r["accepted"])


for i, cycles in enumerate(rounds):
    drafting = [r for r in cycles if max(r["widths"]) > 1]
    plain = [r for r in cycles if max(r["widths"]) == 1]
    rows = max(len(r["widths"]) for r in cycles)

    def rate(group):
        return sum(committed(r) for r in group) / max(1e-9, sum(r["ms"] for r in group))
    full = [r["ms"] for r in plain if len(r["widths"]) == rows]
    line = (f"round {i}: {len(cycles)} cycles, up to {rows} rows, {sum(r['ms'] for r in cycles) / 1000:.2f} s; "
            f"one-token cycles {len(plain)} ({rate(plain):.2f} tok/ms"
            f"{f', median ms at most rows {statistics.median(full):.2f}' if full else ''}); "
            f"drafting cycles {len(drafting)}")
    if drafting:
        line += (f" ({rate(drafting):.2f} tok/ms; rows drafting per cycle "
                 f"{statistics.mean(sum(w > 1 for w in r['widths']) for r in drafting):.1f}, widths "
                 f"{sorted({w for r in drafting for w in r['widths'] if w > 1})}, "
                 f"{sum(r['ms'] for r in drafting) / 1000:.2f} s, joined in them {sum(r['joined'] for r in drafting)})")
    print(line)


if len(sys.argv) > 3:
    start = next(i for i, r in enumerate(records) if len(r["widths"]) > int(sys.argv[3]))
    level = [r for r in records[start - 1:] if len(r["widths"]) > 1 or r["joined"]]
    kinds = {}
    for r in level:
        kind = ("drafting" if max(r["widths"]) > 1 else "one-token") + (" + joins" if r["joined"] else "")
        n, ms, tokens = kinds.get(kind, (0, 0.0, 0))
        kinds[kind] = (n + 1, ms + r["ms"], tokens + committed(r))
    total = sum(ms for _, ms, _ in kinds.values())
    for kind, (n, ms, tokens) in kinds.items():
        print(f"{kind:20s} {n:4d} cycles, {ms / 1000:.2f} s ({100 * ms / total:.0f} %), {tokens} tokens, "
              f"{tokens / ms:.2f} tokens/ms")
