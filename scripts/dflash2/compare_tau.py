"""Side-by-side tau distributions of drafters from `scripts/drafter/eval_tau.py` results, per set (in-domain,
out-of-domain): every prompt of the set's cells (endings x lengths) pooled, min / p10 / median / mean over prompts,
and each drafter's mean against the first one's.

    python scripts/dflash2/compare_tau.py NAME=runs/.../results.json NAME=runs/.../results.json [...]

Only cells present in every file are pooled (eval_tau cuts their prompts deterministically; a cell can hold a
prompt or two fewer in one file, see the prompts column).

What this script does not know about: how the figures were produced (read each file's label and settings).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def pooled(results: dict, cells: list[str], set_name: str) -> list[float]:
    return [t for c in cells if c.startswith(set_name + "|") for t in results["cells"][c]["per_prompt_tau"]]


def table(named: list[tuple[str, dict]]) -> str:
    cells = sorted(set.intersection(*(set(r["cells"]) for _, r in named)))
    lines = [f"cells: {', '.join(cells)}", "",
             "| set | drafter | prompts | min | p10 | median | mean | mean / first |", "|---|---|---|---|---|---|---|---|"]
    for set_name in ("in-domain", "ood"):
        first = None
        for name, results in named:
            taus = pooled(results, cells, set_name)
            if not taus:
                continue
            mean = statistics.fmean(taus)
            first = first or mean
            lines.append(f"| {set_name} | {name} | {len(taus)} | {min(taus):.2f} | {quantile(taus, 0.1):.2f} | "
                         f"{statistics.median(taus):.2f} | {mean:.2f} | {mean / first:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or any("=" not in a for a in argv):
        print("usage: compare_tau.py NAME=results.json NAME=results.json [...]", file=sys.stderr)
        return 2
    named = []
    for arg in argv:
        name, path = arg.split("=", 1)
        try:
            named.append((name, json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            print(f"compare_tau.py: cannot read {path}: {e}", file=sys.stderr)
            return 2
    print(table(named), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
