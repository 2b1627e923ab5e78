"""Benchmark output: the console table (rich), `results.json`, `results.md` (a Markdown table for READMEs) and PNG
plots (matplotlib, Agg backend): acceptance-length histogram, per-position acceptance, speedup per method,
throughput vs concurrency (server mode).

What this module does not know about: how results were measured.
"""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _lossless_cell(s: dict, rich: bool) -> str:
    m = s.get("mismatches")
    n = s.get("num_prompts")
    if m is None:
        return "n/a" if not s.get("lossless", True) else "-"
    if m == 0:
        return ("[green]ok[/green]" if rich else "ok") if n is None else (f"[green]ok {n}/{n}[/green]" if rich
                                                                          else f"ok {n}/{n}")
    text = f"{m} MISMATCH" + ("" if n is None else f" /{n}")
    return f"[bold red]{text}[/bold red]" if rich else text


OFFLINE_COLUMNS = ["dataset", "method", "tau", "tau per prompt (min/p10/med/mean)", "accept rate", "verify w",
                   "1-token steps (+ lookup)", "tok/s", "speedup", "TTFT ms", "TPOT ms", "greedy = target"]


def offline_rows(results: dict, rich: bool = False) -> list[list[str]]:
    rows = []
    multi = len(results["datasets"]) > 1
    sections = list(results["datasets"].items()) + ([("all", None)] if multi else [])
    for label, d in sections:
        methods = results["summary"] if d is None else d["methods"]
        for name, s in methods.items():
            s = dict(s)
            if d is not None:
                s["num_prompts"] = d["num_prompts"]
            width = 1 + s["num_draft_tokens"] / s["num_drafts"] if s.get("num_drafts") else None
            rows.append([label, name, _fmt(s["tau"]), _distribution_cell(s.get("tau_per_prompt")),
                         _fmt(s["acceptance_rate"]), _fmt(width, ".1f"),
                         _steps_cell(s), _fmt(s["tokens_per_second"], ".1f"),
                         _fmt(s["speedup"], ".2f") + ("x" if s["speedup"] is not None else ""),
                         _fmt(s["ttft_ms"], ".1f"), _fmt(s["tpot_ms"], ".2f"), _lossless_cell(s, rich)])
    return rows


def _distribution_cell(d: dict | None) -> str:
    return "-" if not d else f"{d['min']:.2f} / {d['p10']:.2f} / {d['median']:.2f} / {d['mean']:.2f}"


def _steps_cell(s: dict) -> str:
    """One-token steps, and the steps that verified a lookup continuation instead with the tokens it accepted."""
    steps, lookups = s.get("one_token_steps") or 0, s.get("lookup_steps")
    if lookups:
        return f"{steps} + {lookups} ({s.get('lookup_accepted', 0)} accepted)"
    return str(steps) if steps else "-"


SERVER_COLUMNS = ["server", "concurrency", "requests", "tok/s", "speedup", "tok/CPU-s (speedup)", "TTFT ms (p50)",
                  "TPOT ms", "tau", "accept rate", "greedy = ref"]


def _per_cpu(lv: dict) -> str:
    """Output tokens per CPU-second of the server (and that speedup), where its /metrics gave its CPU time."""
    if lv.get("tok_per_cpu_s") is None:
        return "-"
    speedup = lv.get("cpu_speedup")
    return _fmt(lv["tok_per_cpu_s"], ".1f") + (f" ({speedup:.2f}x)" if speedup is not None else "")


def server_rows(results: dict, rich: bool = False) -> list[list[str]]:
    rows = []
    for name, srv in results["servers"].items():
        for lv in srv["levels"]:
            m = lv.get("mismatches")
            if m is None:
                cell = "-"
            elif m == 0:
                cell = "[green]ok[/green]" if rich else "ok"
            else:
                cell = f"[bold red]{m} MISMATCH[/bold red]" if rich else f"{m} MISMATCH"
            req = f"{lv['num_requests']}" + (f" ({lv['errors']} failed)" if lv["errors"] else "")
            rows.append([name, str(lv["concurrency"]), req, _fmt(lv["throughput_tok_s"], ".1f"),
                         _fmt(lv.get("speedup"), ".2f") + ("x" if lv.get("speedup") is not None else ""),
                         _per_cpu(lv), f"{_fmt(lv['ttft_ms'], '.1f')} ({_fmt(lv['ttft_ms_p50'], '.1f')})",
                         _fmt(lv["tpot_ms"]),
                         _fmt(lv.get("tau")), _fmt(lv.get("acceptance_rate")), cell])
    return rows


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def print_tables(results: dict, console) -> None:
    from rich.table import Table

    if results.get("mode") == "offline" or "datasets" in results:
        t = Table(title="flashdraft bench (in-process, batch 1, methods interleaved per prompt)")
        for c in OFFLINE_COLUMNS:
            t.add_column(c, justify="left" if c in ("dataset", "method") else "right",
                         no_wrap=c in ("dataset", "method"))
        for r in offline_rows(results, rich=True):
            t.add_row(*r)
        console.print(t)
    if "servers" in results:
        t = Table(title="flashdraft bench (server, concurrency sweep)")
        for c in SERVER_COLUMNS:
            t.add_column(c, justify="left" if c == "server" else "right", no_wrap=c == "server")
        for r in server_rows(results, rich=True):
            t.add_row(*r)
        console.print(t)
    for note in results.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")
    for line in verdict_lines(results):
        console.print(line)


def lossless_failures(results: dict) -> dict[str, int]:
    """{method or server@concurrency: number of mismatching prompts} for everything that failed the check."""
    bad = {}
    ll = results.get("losslessness") or {}
    for name, n in (ll.get("mismatches") or {}).items():
        if n:
            bad[name] = n
    for name, srv in (results.get("servers") or {}).items():
        for lv in srv["levels"]:
            if lv.get("mismatches"):
                bad[f"{name}@{lv['concurrency']}"] = lv["mismatches"]
    return bad


def verdict_lines(results: dict) -> list[str]:
    lines = []
    ll = results.get("losslessness")
    if ll is not None:
        if not ll.get("checked"):
            lines.append(f"losslessness: not checked ({ll.get('reason')})")
        elif ll["passed"]:
            lines.append("[bold green]losslessness: PASS[/bold green] - every lossless method's greedy output "
                         f"equals {ll.get('reference', 'the reference')}, token for token, on every prompt")
        else:
            for name, n in ll["mismatches"].items():
                if n:
                    where = "; ".join(f"{ds}: prompts {idx}" for ds, idx in ll["mismatched_prompts"][name].items()
                                      if idx)
                    lines.append(f"[bold red]LOSSLESSNESS FAILURE: {name} differs from the target's own greedy "
                                 f"generate on {n} prompt(s) ({where})[/bold red]")
    for name, srv in (results.get("servers") or {}).items():
        for lv in srv["levels"]:
            if lv.get("mismatches"):
                lines.append(f"[bold red]OUTPUT MISMATCH: server {name} at concurrency {lv['concurrency']}: "
                             f"{lv['mismatches']} prompt(s) differ from {srv.get('reference')} "
                             f"({lv['mismatched_prompts']})[/bold red]")
    return lines


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, default=str))


def write_markdown(results: dict, path: Path) -> str:
    parts = []
    if "datasets" in results:
        parts.append(markdown_table(OFFLINE_COLUMNS, offline_rows(results)))
    if "servers" in results:
        parts.append(markdown_table(SERVER_COLUMNS, server_rows(results)))
    text = "\n".join(parts)
    path.write_text(text)
    return text


# ---- plots ------------------------------------------------------------------------------------------------------

def _spec_methods(summary: dict) -> dict:
    return {n: s for n, s in summary.items() if s.get("acceptance_histogram") and s.get("num_drafts")}


def write_plots(results: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))

    # acceptance sources: offline methods (pooled over datasets) and server levels with counters
    acc = {}
    if "summary" in results:
        acc.update(_spec_methods(results["summary"]))
    for name, srv in (results.get("servers") or {}).items():
        for lv in srv["levels"]:
            if lv.get("acceptance_histogram"):
                acc[f"{name} c={lv['concurrency']}"] = lv

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if acc:
        width = 0.8 / len(acc)
        for k, (name, s) in enumerate(acc.items()):
            hist = s["acceptance_histogram"]
            total = max(1, sum(hist))
            xs = [i + 1 + (k - (len(acc) - 1) / 2) * width for i in range(len(hist))]
            ax.bar(xs, [h / total for h in hist], width=width, label=f"{name} (tau {_fmt(s.get('tau'))})")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative method with drafts", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("acceptance length (accepted drafts + bonus)")
    ax.set_ylabel("share of verification cycles")
    ax.set_title("Acceptance-length histogram")
    save(fig, "acceptance_histogram.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in acc.items():
        pp = s["per_position_acceptance"]
        ax.plot(range(1, len(pp) + 1), pp, marker="o", label=name)
    if acc:
        ax.legend()
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title("Per-position acceptance rate")
    save(fig, "per_position_acceptance.png")

    if "datasets" in results:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = list(results["datasets"])
        names = list(results["summary"])
        width = 0.8 / max(1, len(labels))
        for k, label in enumerate(labels):
            ms = results["datasets"][label]["methods"]
            vals = [ms[n]["speedup"] or 0.0 for n in names]
            xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(names))]
            bars = ax.bar(xs, vals, width=width, label=label)
            ax.bar_label(bars, fmt="%.2fx", fontsize=8)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("speedup over ar (tokens/s ratio)")
        ax.set_title("Speedup per method (same prompts, same run)")
        if len(labels) > 1:
            ax.legend()
        save(fig, "speedup.png")

    if "servers" in results:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for name, srv in results["servers"].items():
            cs = [lv["concurrency"] for lv in srv["levels"]]
            ax1.plot(cs, [lv["throughput_tok_s"] for lv in srv["levels"]], marker="o", label=name)
            ax2.plot(cs, [lv["ttft_ms"] or 0 for lv in srv["levels"]], marker="o", label=name)
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.legend()
        ax1.set_ylabel("output tokens/s")
        ax1.set_title("Throughput vs concurrency")
        ax2.set_ylabel("mean TTFT (ms)")
        ax2.set_title("Time to first token vs concurrency")
        save(fig, "throughput_concurrency.png")
    return written
