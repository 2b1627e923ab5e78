"""What a token tree costs on this machine: one target forward verifying a tree of N nodes against a one-token
step, the draft that builds it, and the tokens/s the measured tau curve then buys.

    python scripts/tree/verify_cost.py [--target DIR --draft DIR] [--context 256] [--rows 1,16]
                                       [--budgets 8,16,32,64,128] [--iters 15] [--threads 1]
                                       [--tau runs/tree/shipped/results.json] [--json runs/tree/verify_cost.json]
    python scripts/tree/verify_cost.py --tiny --iters 2          # random tiny pair: a smoke run (what CI does)

Every step is the engine's own (a `SpecEngine`'s fast target and proposer, with its weight packing), on static
caches holding `--context` positions per row (their values do not change the time): the one-token step and the
16-token chain verify through `PagedTargetKV.forward_block` (the one-token step without features, as plain
decoding runs it), the chain's acceptance (`verify.verify`) apart; a tree of N nodes besides the root through
`forward_ragged` with its ancestor mask (`tree.TokenTree.ancestors` + `tree_attention_mask`, built in the timed
call as `SpecEngine._tree_step` builds them), the walk (`verify.verify_tree`, greedy) and the accepted path's K/V
move (`move_slots`) apart. The chain's draft is `DFlashProposer.propose`; a tree's is `propose_candidates` plus
`tree.best_first` per row. Trees are best-first over fixed, geometric candidate probabilities: their shape does
not change the time (the mask is dense), only their node count does. Each figure is the median thread CPU time
of `--iters` runs after 3 warm-up runs, all the calls alternating round by round (one torch thread, so every op
runs in the timed thread: CPU time counts the work, not the share of the cores a niced process got from its
neighbours; median wall times are saved too).

Projected speed relative to plain decoding at budget N = tau(N) * t_step / (t_draft(N) + t_verify(N) + t_walk(N))
(the chain: its draft, verify and acceptance), with tau(N) the mean tau per cell from `tau_curve.py`'s results
(greedy): what the engine would gain if nothing else in a cycle cost anything. The machine's load (load average,
the processes using most CPU) is printed and saved with the figures: CPU time is robust to being descheduled but
not to caches and memory bandwidth shared with the neighbours, so on a busy machine every time here is at most a
little above the idle machine's.

`--e2e-prompts N` then checks the projection against the engine itself: N in-domain held-out prompts (greedy, fixed
policy, at each row count) through plain decoding, the chain, each budget and `tree_budget="auto"`, as committed
tokens per second of thread CPU time against plain decoding's (and that every output equals plain decoding's).

What this script does not know about: acceptance (it reads tau from tau_curve.py), the adaptive draft policy, GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashdraft.loading import DEFAULT_TARGET  # noqa: E402
from scripts.speed.gpu_shapes import TINY, build_pair  # noqa: E402

CHAIN_WIDTH = 16


def parse_ints(text: str, option: str, low: int, high: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{option}: {text!r} is not a comma-separated list of integers") from None
    if not values or any(not low <= v <= high for v in values):
        raise SystemExit(f"{option}: {text!r}: use integers in [{low}, {high}]")
    return values


def geometric_candidates(depth: int, top: int, ratio: float = 0.5) -> tuple[list, list]:
    """Candidate tokens and log-probabilities for `depth` positions, `top` each: a fixed, plausible shape (rank r
    has probability ~ ratio^r, normalised), so best-first trees branch near the root and run deep along rank 0."""
    weights = [ratio ** r for r in range(top)]
    logp = [math.log(w / sum(weights)) for w in weights]
    return [[(7 * d + r) % 1000 + 2 for r in range(top)] for d in range(depth)], [logp] * depth


def machine_load() -> dict:
    """Load average and the five processes using most CPU (to see what else ran during the timings)."""
    top = subprocess.run(["ps", "-eo", "pid,ni,pcpu,etime,args", "--sort=-pcpu"], capture_output=True,
                         text=True).stdout.splitlines()[:6]
    return {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "top": [line[:160] for line in top]}


def load_models(args):
    """(target TargetModel, drafter) from the shipped pair, --target/--draft, or a random tiny pair (--tiny)."""
    import torch

    from flashdraft.model import TargetModel

    if args.tiny:
        return build_pair(TINY, 1, CHAIN_WIDTH, "cpu", torch.float32)
    from flashdraft.loading import load_pair

    model, _, drafter = load_pair(args.target, args.draft, "cpu")
    if drafter is None:
        raise SystemExit("no drafter: pass --draft DIR with --target")
    target = TargetModel(model)
    target.set_layer_ids(drafter.target_layer_ids)
    return target, drafter


def interleaved_ms(calls: dict, iters: int) -> dict:
    """{name: (median thread CPU ms, median wall ms)} of each call, after 3 warm-up calls each; the calls alternate
    round by round, so a change in the machine's load falls on all of them alike. Thread CPU time (one torch
    thread: every op runs in this thread) counts the work, not the time the scheduler gave other processes: under
    `nice` on a busy machine the wall times can be several times longer and vary with the neighbours."""
    for fn in calls.values():
        for _ in range(3):
            fn()
    cpu, wall = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(iters):
        for name, fn in calls.items():
            c0, w0 = time.thread_time(), time.perf_counter()
            fn()
            cpu[name].append(1e3 * (time.thread_time() - c0))
            wall[name].append(1e3 * (time.perf_counter() - w0))
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in calls}


def measure_rows(target, drafter, rows: int, context: int, budgets: list[int], iters: int) -> dict:
    """Median ms (thread CPU time; wall time beside it) of: the one-token step, the chain's draft and verify, and
    per budget the tree's draft, verify forward (mask included) and walk + K/V move, for `rows` rows each holding
    `context` positions."""
    import torch

    from flashdraft.engine import EngineConfig, SpecEngine
    from flashdraft.engine.batch import Features, RowBuckets
    from flashdraft.engine.proposers import ProposalInput
    from flashdraft.engine.target_kv import PagedTargetKV
    from flashdraft.engine.tree import TREE_CANDIDATES, best_first, stack, tree_attention_mask
    from flashdraft.engine.verify import SamplingParams, verify, verify_tree

    dev = target.device
    # the engine's own fast target and proposer, with its weight packing (the proposer's unpacked bf16 read-out
    # takes a much slower path on the [:, 1:] slice of a batch's hidden states)
    engine = SpecEngine(target, drafter, None, EngineConfig(draft_policy="fixed", tree_budget=max(budgets)))
    fast, proposer = engine.fast, engine.proposer
    capacity = context + max(budgets + [CHAIN_WIDTH]) + 1
    kv = PagedTargetKV(fast, fast.new_cache(rows, capacity), rows, RowBuckets())
    idx = torch.arange(rows, device=dev)
    n_cached = torch.full((rows,), context, dtype=torch.long, device=dev)
    ids = torch.randint(2, target.vocab_size - 1, (rows, CHAIN_WIDTH), device=dev)
    positions = context + torch.arange(CHAIN_WIDTH, device=dev)[None].expand(rows, -1).contiguous()
    calls = {"step": lambda: kv.forward_block(ids[:, :1], positions[:, :1].contiguous(), False, context + 1),
             "chain_verify": lambda: kv.forward_block(ids, positions, True, context + CHAIN_WIDTH)}

    state = proposer.new_batch_state()
    state.grow([capacity] * rows)
    width = target.config.hidden_size * len(drafter.target_layer_ids)
    features = Features(torch.randn(rows, CHAIN_WIDTH, width, device=dev, dtype=drafter.dtype), positions - CHAIN_WIDTH,
                        torch.ones(rows, CHAIN_WIDTH, dtype=torch.bool, device=dev))
    inp = ProposalInput(ids[:, 0], positions, context, features)
    calls["chain_draft"] = lambda: proposer.propose(state, inp, CHAIN_WIDTH)
    candidates, logp = geometric_candidates(CHAIN_WIDTH - 1, TREE_CANDIDATES)
    greedy = [SamplingParams(max_new_tokens=1)] * rows
    chain_logits = calls["chain_verify"]()[0]
    calls["chain_walk"] = lambda: verify(chain_logits, ids[:, 1:], greedy)

    def tree_draft(budget):
        proposer.propose_candidates(state, inp, CHAIN_WIDTH, TREE_CANDIDATES)
        return [best_first(int(ids[r, 0]), candidates, logp, budget) for r in range(rows)]

    nodes = {}
    for budget in budgets:
        tree = stack(tree_draft(budget), dev)
        nodes[budget] = tree.num_nodes
        slots = n_cached[:, None] + torch.arange(tree.num_nodes, device=dev)[None]
        end = context + tree.num_nodes

        def forward(tree=tree, slots=slots, end=end):
            mask = tree_attention_mask(tree.ancestors(), n_cached, end)
            return kv.forward_ragged([(idx, tree.tokens, n_cached[:, None] + tree.depths, slots, mask)], True, end)

        def walk(tree=tree, logits=forward()[0][0]):
            verdict = verify_tree(logits, tree, greedy)
            depth = max(map(len, verdict.paths))
            path = torch.tensor([p + [p[-1]] * (depth - len(p)) for p in verdict.paths], device=dev)
            kv.move_slots(idx, n_cached[:, None] + path, n_cached[:, None] + torch.arange(depth, device=dev)[None])

        calls[f"{budget}/draft"] = lambda b=budget: tree_draft(b)
        calls[f"{budget}/verify"] = forward
        calls[f"{budget}/walk"] = walk
    times = interleaved_ms(calls, iters)
    engine.close()
    out = {"pack_weights": engine.pack_weights, "rows": rows, "context": context,
           "wall_ms": {name: round(t[1], 3) for name, t in times.items()}}
    out.update({f"{name}_ms": times[name][0] for name in ("step", "chain_verify", "chain_draft", "chain_walk")})
    out["trees"] = {str(b): {"nodes": nodes[b], **{f"{part}_ms": times[f"{b}/{part}"][0]
                                                   for part in ("draft", "verify", "walk")}} for b in budgets}
    return out


def end_to_end(target, drafter, tokenizer, prompts: list[list[int]], configs: list, rows: int,
               max_new_tokens: int) -> dict:
    """The engine itself, greedy, fixed draft policy: committed tokens per second of thread CPU time for plain
    decoding and each configuration (0 = the chain, N = a tree budget, "auto"), `rows` prompts per batch, and
    whether each one's tokens equal plain decoding's (they must: greedy is lossless)."""
    import time as clock

    from flashdraft.engine import EngineConfig, SamplingParams, SpecEngine

    params = SamplingParams(max_new_tokens=max_new_tokens)
    out, reference = {}, None
    for config in ["plain"] + configs:
        engine = (SpecEngine(target, None, tokenizer) if config == "plain" else
                  SpecEngine(target, drafter, tokenizer, EngineConfig(draft_policy="fixed", tree_budget=config)))
        engine.generate(prompts[:rows], SamplingParams(max_new_tokens=8))  # warm-up
        started, results = clock.thread_time(), []
        for first in range(0, len(prompts), rows):
            results += engine.generate(prompts[first:first + rows], params)
        cpu = clock.thread_time() - started
        engine.close()
        tokens = [r.token_ids for r in results]
        reference = reference or tokens
        name = "plain" if config == "plain" else "chain" if config == 0 else str(config)
        lengths = [a for r in results for a in r.stats.acceptance_lengths]
        out[name] = {"tokens_per_cpu_s": sum(map(len, tokens)) / cpu, "same_as_plain": tokens == reference,
                     "tau": sum(lengths) / len(lengths) if lengths else 1.0}
    for figures in out.values():
        figures["vs_plain"] = figures["tokens_per_cpu_s"] / out["plain"]["tokens_per_cpu_s"]
    return out


def read_tau(path: Path | None) -> dict:
    """{budget name ("chain", "8", ...): {cell: mean tau}} of tau_curve.py's greedy curve ({} without one)."""
    if path is None:
        return {}
    if not path.is_file():
        raise SystemExit(f"--tau {path}: no such file (run scripts/tree/tau_curve.py first)")
    curve = json.loads(path.read_text())["curves"]["greedy"]
    return {name: {cell: r["mean"] for cell, r in row.items()} for name, row in curve.items()}


def projections(measured: dict, tau: dict) -> dict:
    """Per configuration ("chain", budgets): speed relative to plain decoding per cell and averaged over cells,
    tau * t_step / (t_draft + t_verify + t_walk)."""
    step = measured["step_ms"]
    configs = {"chain": measured["chain_draft_ms"] + measured["chain_verify_ms"] + measured.get("chain_walk_ms", 0.0)}
    for budget, t in measured["trees"].items():
        configs[budget] = t["draft_ms"] + t["verify_ms"] + t["walk_ms"]
    out = {}
    for name, cycle in configs.items():
        if name not in tau:
            continue
        per_cell = {cell: round(t * step / cycle, 3) for cell, t in tau[name].items()}
        out[name] = {"cycle_ms": round(cycle, 3), "per_cell": per_cell,
                     "mean": round(sum(per_cell.values()) / len(per_cell), 3)}
    return out


def table(result: dict) -> str:
    lines = ["| rows | verify | tokens | draft ms | verify ms | walk + move ms | verify / 1-token step | "
             "projected speed vs plain (mean of cells) |", "|---|---|---|---|---|---|---|---|"]
    for m in result["measurements"]:
        proj = m.get("projection", {})
        lines.append(f"| {m['rows']} | 1-token step | 1 | - | {m['step_ms']:.2f} | - | 1.00 | 1.00x |")
        chain = proj.get("chain", {}).get("mean")
        lines.append(f"| {m['rows']} | chain | {CHAIN_WIDTH} | {m['chain_draft_ms']:.2f} | "
                     f"{m['chain_verify_ms']:.2f} | {m['chain_walk_ms']:.2f} | "
                     f"{m['chain_verify_ms'] / m['step_ms']:.2f} | {f'{chain:.2f}x' if chain else '-'} |")
        for budget, t in m["trees"].items():
            p = proj.get(budget, {}).get("mean")
            lines.append(f"| {m['rows']} | tree {budget} | {t['nodes']} | {t['draft_ms']:.2f} | "
                         f"{t['verify_ms']:.2f} | "
                         f"{t['walk_ms']:.2f} | {t['verify_ms'] / m['step_ms']:.2f} | {f'{p:.2f}x' if p else '-'} |")
    return "\n".join(lines) + "\n"


def verdict(result: dict) -> list[str]:
    """Which configuration the projection favours, per row count."""
    out = []
    for m in result["measurements"]:
        proj = m.get("projection")
        if not proj:
            continue
        best = max(proj, key=lambda name: proj[name]["mean"])
        chain = proj.get("chain", {}).get("mean")
        paying = [b for b, p in proj.items() if b != "chain" and chain and p["mean"] > chain]
        out.append(f"{m['rows']} row(s): best projected = {best} ({proj[best]['mean']:.2f}x plain); trees above the "
                   f"chain ({chain:.2f}x): {', '.join(paying) or 'none'}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target directory (default: the shipped pair's)")
    ap.add_argument("--draft", default=None, help="drafter directory (default: the shipped pair's)")
    ap.add_argument("--tiny", action="store_true", help="a random tiny pair instead (smoke run)")
    ap.add_argument("--context", type=int, default=256, help="positions each row holds in the caches")
    ap.add_argument("--rows", default="1,16", help="batch sizes")
    ap.add_argument("--budgets", default="8,16,32,64,128", help="tree nodes besides the root")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tau", type=Path, default=None, help="tau_curve.py's results.json, for the projection")
    ap.add_argument("--e2e-prompts", type=int, default=16,
                    help="also run the engine on this many in-domain held-out prompts (0: not; never with --tiny)")
    ap.add_argument("--e2e-tokens", type=int, default=128, help="new tokens per prompt of the end-to-end run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = parse_ints(args.rows, "--rows", 1, 256)
    budgets = parse_ints(args.budgets, "--budgets", 1, 512)
    if not 1 <= args.context <= 8192 or args.iters < 1:
        ap.error("--context must be in [1, 8192] and --iters >= 1")
    if args.e2e_prompts < 0 or args.e2e_tokens < 1:
        ap.error("--e2e-prompts must be >= 0 and --e2e-tokens >= 1")
    tau = read_tau(args.tau)

    import torch

    torch.set_num_threads(args.threads)
    target, drafter = load_models(args)
    load_before = machine_load()
    measurements = []
    with torch.inference_mode():
        for n in rows:
            m = measure_rows(target, drafter, n, args.context, budgets, args.iters)
            if tau:
                m["projection"] = projections(m, tau)
            measurements.append(m)
            print(f"  rows {n}: step {m['step_ms']:.2f} ms, chain {m['chain_verify_ms']:.2f} ms, trees "
                  + ", ".join(f"{b}: {t['verify_ms']:.2f}" for b, t in m["trees"].items()), flush=True)
    e2e = {}
    if args.e2e_prompts and not args.tiny:
        from transformers import AutoTokenizer

        from scripts.drafter.eval_tau import short_prompts

        tokenizer = AutoTokenizer.from_pretrained(args.target or DEFAULT_TARGET)
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"]
                   for p in short_prompts("in-domain", "mid-line", args.e2e_prompts)]
        with torch.inference_mode():
            for n in rows:
                e2e[str(n)] = end_to_end(target, drafter, tokenizer, prompts, [0] + budgets + ["auto"], n,
                                         args.e2e_tokens)
    result = {"pair": "tiny (random)" if args.tiny else (args.draft or "shipped"), "threads": args.threads,
              "context": args.context, "iters": args.iters, "tau_from": str(args.tau) if args.tau else None,
              "load_before": load_before, "load_after": machine_load(), "measurements": measurements,
              "end_to_end": e2e, "e2e_prompts": args.e2e_prompts, "e2e_tokens": args.e2e_tokens}
    print(f"\nCPU, {args.threads} thread(s), {args.context} cached positions per row, median thread CPU time of "
          f"{args.iters} interleaved rounds; "
          f"load average before {load_before['loadavg'][0]:.2f}, after {result['load_after']['loadavg'][0]:.2f} "
          f"on {load_before['cpus']} CPUs; busiest processes before:")
    print("\n".join("    " + line for line in load_before["top"]))
    print()
    print(table(result))
    for line in verdict(result):
        print(line)
    if e2e:
        print(f"\nengine end to end ({args.e2e_prompts} in-domain held-out prompts x {args.e2e_tokens} new tokens, "
              "greedy, fixed policy): tokens per CPU-second vs plain decoding (tau)")
        for n, figures in e2e.items():
            print(f"  {n} row(s): " + ", ".join(f"{name} {f['vs_plain']:.2f}x ({f['tau']:.2f})"
                                                + ("" if f["same_as_plain"] else " OUTPUT DIFFERS")
                                                for name, f in figures.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
