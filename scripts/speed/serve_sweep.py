"""DFlash against plain decoding as users meet it: two `flashdraft serve` processes (drafting, and `--no-draft`),
a concurrency sweep at temperature 0 and 1 on the shipped pair's held-out prompts and on out-of-domain code
(cut from installed packages' sources, half ending mid-line, half at a line start), and batch 1 with another
process keeping one core busy. Every cell is one `flashdraft bench --server` level, the two servers interleaved
level by level; the ratio is DFlash's output tokens per second over plain decoding's, and the CPU ratio the same
for output tokens per CPU-second of each server process (its `process_cpu_seconds_total`): on a machine shared
with other work the wall-time ratio of one cell moves by +-10-40 % between rounds, the work per token much less.

    python scripts/speed/serve_sweep.py                        # the full table (about 15 minutes on 2 cores)
    python scripts/speed/serve_sweep.py --concurrency 1,16 --temperatures 0 --serve-args="--draft-policy fixed"
    python scripts/speed/serve_sweep.py --temperatures 0.7 --top-p 0.95    # the settings users serve

Writes runs/serve_sweep/results.json, table.md and ratio.png. Extra `--serve-args` go to the drafting server
only (e.g. `--draft-policy fixed` for the fixed-block behaviour); `--compare-args` starts a second drafting server
with its own flags, run in the same interleaved rounds (e.g. `--serve-args="--tree-budget auto" --compare-args=""`:
trees and the chain side by side against the same plain decoding); `--compare-checkout DIR` runs that server from
another checkout (`git worktree add /tmp/before HEAD~1`: a code change against the code before it, in one run).
`--control` adds a second `--no-draft` server (with `--control-args`, if given) to the rounds: plain decoding
against itself shows how far a ratio moves on this machine with nothing changed (on the 2-core benchmark machine
single rounds of plain against plain ranged 0.82-1.25x at 4-32 requests).

What this script does not know about: how the servers decode (it only starts them and speaks HTTP).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shlex
import sys
import time
from pathlib import Path

from flashdraft.args import finite_float_in, top_p_arg
from flashdraft.bench.datasets import load_prompts
from flashdraft.bench.server import local_server, run_servers

SETS = {"held-out": ["default"], "out-of-domain": ["ood-code", "ood-code-nl"]}


@contextlib.contextmanager
def server(name: str, extra: list[str], threads: int, max_batch: int, log_dir: Path, cpus: set[int] | None = None,
           checkout: str | None = None):
    """A `flashdraft serve` process on a free port (on `cpus` only, when given; the flashdraft of `checkout`, when
    given); yields its base URL."""
    args = ["--threads", str(threads), "--max-batch-size", str(max_batch), "--max-queue", str(4 * max_batch),
            "--log-level", "warning", *extra]
    with open(log_dir / f"{name}.log", "w") as log, local_server(args, log, f"{name} server", cwd=checkout,
                                                                cpus=cpus) as (url, _):
        yield url


def _spin(stop) -> None:
    while not stop.is_set():
        pass


@contextlib.contextmanager
def busy_core(enabled: bool, cpus: set[int] | None = None):
    """Another process keeping one core busy (a batch job, a second service) while the cell runs, free to run on
    any of `cpus` (None: wherever this process may)."""
    if not enabled:
        yield
        return
    stop = multiprocessing.Event()
    proc = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
    proc.start()
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    try:
        yield
    finally:
        stop.set()
        proc.join(timeout=5)


def cell(urls: dict, prompts, concurrency: int, temperature: float, max_tokens: int, rounds: int,
         request_rate: float | None = None, top_p: float = 1.0) -> dict:
    """One cell: every server at one concurrency level, `rounds` alternating rounds. The ratio is of throughputs
    summed over the rounds; each round's own ratio is kept too (`round_ratios`: their spread is this machine's
    run-to-run noise at that load), and tau is the mean of the rounds'. Where the servers report their CPU time
    (`process_cpu_seconds_total`), `cpu_ratio` is the same ratio of output tokens per CPU-second of each server:
    the work a token costs, which the machine's other load moves far less than it moves wall time."""
    tokens = {name: 0 for name in urls}
    seconds = {name: 0.0 for name in urls}
    cpu_seconds = {name: 0.0 for name in urls}
    per_round = {name: [] for name in urls}  # (tokens/s, tau, mismatches, drafting share, tokens/CPU-s) per round
    for r in range(rounds):
        order = list(urls.items()) if r % 2 == 0 else list(urls.items())[::-1]
        res = run_servers([f"{n}={u}" for n, u in order], prompts, [concurrency], max_tokens=max_tokens,
                          temperature=temperature, top_p=top_p, seed=0, ignore_eos=True,
                          request_rate=request_rate)["servers"]
        for name, srv in res.items():
            level = srv["levels"][0]
            if level["errors"]:
                raise RuntimeError(f"{name}: {level['errors']} failed requests at concurrency {concurrency}")
            tokens[name] += level["output_tokens"]
            seconds[name] += level["wall_s"]
            cpu_seconds[name] += level.get("server_cpu_s") or 0.0
            per_round[name].append((level["output_tokens"] / level["wall_s"], level.get("tau"),
                                    level.get("mismatches"), level.get("drafting_share"),
                                    level.get("tok_per_cpu_s")))
    tps = {name: tokens[name] / seconds[name] for name in urls}
    per_cpu = {name: tokens[name] / cpu_seconds[name] if all(x[4] for x in per_round[name]) else None
               for name in urls}
    out = {"ar_tok_s": round(tps["ar"], 1)}
    for name in urls:
        if name == "ar":
            continue
        prefix = "" if name == "dflash" else f"{name}_"
        taus = [t for _, t, _, _, _ in per_round[name] if t is not None]
        mismatches = [m for _, _, m, _, _ in per_round[name] if m is not None]
        shares = [d for _, _, _, d, _ in per_round[name] if d is not None]
        out.update({f"{name}_tok_s": round(tps[name], 1), prefix + "ratio": round(tps[name] / tps["ar"], 3),
                    prefix + "round_ratios": [round(x[0] / a[0], 3) for x, a in
                                              zip(per_round[name], per_round["ar"])],
                    prefix + "tau": round(sum(taus) / len(taus), 4) if taus else None,
                    prefix + "mismatches": sum(mismatches) if mismatches else None,
                    # the share of the rows' cycles that drafted (from the server's counters): 0 means the policy
                    # stepped one token at a time, so the cell's ratio is the drafting server's overhead and noise
                    prefix + "drafting_share": round(sum(shares) / len(shares), 3) if shares else None})
        if per_cpu[name] and per_cpu["ar"]:
            out.update({prefix + "cpu_ratio": round(per_cpu[name] / per_cpu["ar"], 3),
                        prefix + "cpu_round_ratios": [round(x[4] / a[4], 3) for x, a in
                                                      zip(per_round[name], per_round["ar"])]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16,32,64")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--top-p", type=top_p_arg, default=1.0,
                   help="every sampled request's top-p (the settings users serve: 0.9-0.95 at temperature 0.7-1)")
    p.add_argument("--sets", default=",".join(SETS), help=f"prompt sets among {list(SETS)}")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per set (each dataset of a set shares them)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per cell")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--no-busy", action="store_true", help="skip the batch-1 cell beside a busy core")
    p.add_argument("--serve-args", default="", help="extra flags for the drafting server")
    p.add_argument("--compare-args", default=None,
                   help="a second drafting server with these flags (e.g. the default, \"\"), in the same rounds")
    p.add_argument("--compare-checkout", default=None, metavar="DIR",
                   help="run the second drafting server from another checkout of flashdraft (e.g. a `git worktree` "
                        "of the commit before a change), with --compare-args' flags if given: code A/B in one run")
    p.add_argument("--control", action="store_true",
                   help="a second plain-decoding server in the same rounds: its ratio to the first is this "
                        "machine's noise at each cell, the band a DFlash ratio must be read against")
    p.add_argument("--control-args", default="",
                   help="extra flags for the --control server (e.g. \"--mixed-prefill-tokens 0\": plain decoding "
                        "as it ran before joins rode the cycle, to read --compare-args' server against)")
    p.add_argument("--pin", action="store_true",
                   help="servers on the first CPU, this client on the others (Linux): the client's HTTP and "
                        "tokenizer work no longer lands on the core a server computes on (on the 2-core benchmark "
                        "machine it raised throughput but did not narrow the rounds' spread)")
    p.add_argument("--request-rate", type=finite_float_in(0.0, low_open=True), default=None,
                   help="requests per second arriving as a Poisson process, at most the cell's concurrency in flight "
                        "(default: all at once, a closed loop: each request's successor is sent when it ends)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="every server without its prefix cache (each round sends the same prompts, so with it, "
                        "both sides find round 2's prompts whole)")
    p.add_argument("--output-dir", default="runs/serve_sweep")
    args = p.parse_args(argv)
    server_cpus = all_cpus = None
    if args.pin:
        all_cpus = os.sched_getaffinity(0)
        if len(all_cpus) < 2:
            p.error("--pin needs at least 2 CPUs")
        server_cpus = {min(all_cpus)}
        os.sched_setaffinity(0, all_cpus - server_cpus)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    sets = args.sets.split(",")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = {}
    for s in sets:
        per = max(1, args.num_prompts // len(SETS[s]))
        prompts[s] = [q for spec in SETS[s] for q in load_prompts(spec, per)]
    max_batch = max(concurrencies)
    cells = []
    with contextlib.ExitStack() as servers:
        def start(name, extra, checkout=None):
            extra = [*extra, "--no-enable-prefix-caching"] if args.no_prefix_caching else extra
            return servers.enter_context(server(name, extra, args.threads, max_batch, out, server_cpus, checkout))

        urls = {"dflash": start("dflash", shlex.split(args.serve_args)), "ar": start("ar", ["--no-draft"])}
        if args.compare_args is not None or args.compare_checkout:
            urls["compare"] = start("compare", shlex.split(args.compare_args or ""), args.compare_checkout)
        if args.control:
            urls["control"] = start("control", ["--no-draft", *shlex.split(args.control_args)])
        plan = [(s, t, c, False) for t in temperatures for s in sets for c in concurrencies]
        if not args.no_busy:
            plan += [(s, t, 1, True) for t in temperatures for s in sets]
        for i, (s, t, c, busy) in enumerate(plan, 1):
            started = time.time()
            with busy_core(busy, all_cpus):
                result = cell(urls, prompts[s], c, t, args.max_tokens, args.rounds, args.request_rate, args.top_p)
            row = {"set": s, "temperature": t, "concurrency": c, "busy_core": busy, **result}
            cells.append(row)
            compared = (f"; compare {row['compare_ratio']:.2f}x (tau {row.get('compare_tau')})"
                        if "compare_ratio" in row else "")
            compared += f"; control {row['control_ratio']:.2f}x" if "control_ratio" in row else ""
            print(f"[{i}/{len(plan)}] {s:13s} T={t:g} conc={c:3d}{' busy' if busy else '     '} "
                  f"ratio {row['ratio']:.2f}x (dflash {row['dflash_tok_s']:.0f} / plain {row['ar_tok_s']:.0f} tok/s, "
                  f"tau {row.get('tau')}, drafting {row.get('drafting_share')}){compared} "
                  f"[{time.time() - started:.0f} s]", flush=True)
            (out / "results.json").write_text(json.dumps({"argv": sys.argv, "cells": cells}, indent=1))
    write_table(cells, concurrencies, temperatures, sets, out)
    return 0


def ratio_text(cell: dict, key: str) -> str:
    """"0.93x (0.88-0.99)": the cell's ratio and the range of its rounds' own ratios; a share of drafting cycles
    as "45 %"."""
    if key.endswith("drafting_share"):
        return "" if cell.get(key) is None else f"{100 * cell[key]:.0f} %"
    if cell.get(key) is None:
        return ""
    rounds = cell.get(key.replace("ratio", "round_ratios"), [])
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{cell[key]:.2f}x{spread}"


def write_table(cells, concurrencies, temperatures, sets, out: Path) -> None:
    lines = []
    for key, title in (("ratio", "dflash (--serve-args) / plain decoding"),
                       ("compare_ratio", "compare (--compare-args) / plain decoding"),
                       ("control_ratio", "control: a second plain-decoding server (--control), the noise floor, / "
                                         "plain decoding"),
                       ("cpu_ratio", "dflash / plain decoding, output tokens per CPU-second of each server"),
                       ("compare_cpu_ratio", "compare / plain decoding, output tokens per CPU-second"),
                       ("control_cpu_ratio", "control / plain decoding, output tokens per CPU-second (its noise "
                                             "floor)"),
                       ("drafting_share", "dflash: share of the rows' cycles that drafted (server counters), not "
                                          "one-token steps")):
        if not any(c.get(key) is not None for c in cells):
            continue
        lines += [title, "",
                  "| set | temperature | " + " | ".join(f"conc {c}" for c in concurrencies) + " | batch 1, busy core |",
                  "|---|---|" + "---|" * (len(concurrencies) + 1)]
        for s in sets:
            for t in temperatures:
                row = {(c["concurrency"], c["busy_core"]): c for c in cells
                       if c["set"] == s and c["temperature"] == t}
                vals = [ratio_text(row[(c, False)], key) if (c, False) in row else "" for c in concurrencies]
                busy = ratio_text(row[(1, True)], key) if (1, True) in row else ""
                lines.append(f"| {s} | {t:g} | " + " | ".join(vals) + f" | {busy} |")
        lines.append("")
    (out / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in sets:
        for t in temperatures:
            pts = sorted((c["concurrency"], c["ratio"]) for c in cells
                         if c["set"] == s and c["temperature"] == t and not c["busy_core"])
            line, = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{s}, T={t:g}")
            control = sorted((c["concurrency"], c["control_ratio"]) for c in cells if "control_ratio" in c
                             and c["set"] == s and c["temperature"] == t and not c["busy_core"])
            if control:  # plain against plain: the noise a DFlash ratio moves by with nothing changed
                ax.plot([x for x, _ in control], [y for _, y in control], ls=":", color=line.get_color(), lw=1)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("DFlash / plain decoding throughput" + (" (dotted: plain / plain)" if any(
        "control_ratio" in c for c in cells) else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ratio.png", dpi=120)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
