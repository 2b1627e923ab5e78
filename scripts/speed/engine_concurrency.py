"""The engine under a server's load pattern, without the server: DFlash against plain decoding in one process.

    python scripts/speed/engine_concurrency.py [--concurrency 1,4,16] [--sets held-out,out-of-domain]
        [--num-prompts 32] [--max-tokens 64 | LO-HI] [--temperature 0] [--top-p 1] [--top-k 0] [--rounds 2]
        [--policies adaptive,fixed,never]
        [--compare-draft DIR] [--variant NAME:CONSTANT=VALUE[,CONSTANT=VALUE]]... [--warm-full] [--cudnn-attention]
        [--lockstep] [--dtype bfloat16]
        [--json runs/engine_concurrency.json]

Each cell keeps `concurrency` requests in flight from a queue of the set's prompts, as `flashdraft serve`'s
scheduler does (requests join as soon as others leave, all that join in one `SpecEngine.step`: their prompts
ride the running rows' cycle, or in an empty batch are prefilled first; every live request advances with
`SpecEngine.step`), on the shipped pair, one torch thread, wall time from the first request to the last one's
end. Every engine is warmed up for the cell's concurrency first (`SpecEngine.warmup`), as the server does.
Equal-length greedy requests leave plain decoding's rows in step, so they leave together and their successors
join together, where drafting rows finish apart and join one by one: the joins are timed as the server has them.
Engines: plain decoding (no drafter), then DFlash under each draft policy asked for:
- `adaptive`: the engine's default policy;
- `fixed`: every row verifies the full block every cycle;
- `never`: the drafting engine with a policy that never drafts, i.e. what DFlash costs where it gains nothing
  (the drafter's share of every step: the target's tapped features, the rows' pending context, the policy's
  bookkeeping, without its plans): the floor an ideal policy would reach at loads where drafting does not pay.
- `no-lookup-steps`: the default policy without prompt-lookup continuations at one-token steps (`--lookup-steps 0`).
- `no-trim`: the default policy verifying the widths it planned before the draft (`--no-confidence-trim`).
- `--compare-draft DIR`: one more engine, the default policy with another drafter for the same target (e.g. the
  shipped drafter with a reduced draft vocabulary), column `compare`.
- `--apart`: plain decoding and the default policy with every join prefilled in a forward of its own
  (`mixed_prefill_tokens=0`, as before joins rode the cycle), columns `plain_apart` and `adaptive_apart` (also as
  a ratio to each other).
- `--variant NAME:CONSTANT=VALUE,...` (repeatable): one more engine, the default policy with constants of
  `flashdraft/engine/policy.py` set to those values while it is built, warmed up and runs (restored after),
  column NAME, e.g. `--variant share01:JUDGEMENT_SHARE=0.01`. Policy changes move served ratios less than a
  shared CPU does between runs; side by side in the same interleaved rounds they can be told apart from plain
  decoding's own drift.
Each cell also records, per engine, the mean acceptance length of the requests' first drafting cycles
(`first_cycles`: a request's first drafts accept far less than its later ones, which priors learnt over whole
requests do not see).
Every engine runs every round (the order reversed every other round); the ratio is of tokens summed over rounds.
`--max-tokens LO-HI` gives request i its own length, drawn uniformly from LO..HI (seeded by i, the same for every
engine), as a server's traffic has: with one length for all, plain decoding's rows finish together and the next
wave is prefilled in one forward, where rows that draft or copy finish apart and their successors join one by one.

The served sweep (`serve_sweep.py`) is what users meet; this one takes the HTTP server, its threads and the
client out, so a shortfall there can be split into the engine's (here) and the server's (the rest).

What this script does not know about: HTTP, streaming, detokenisation for clients, other processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.engine import EngineConfig  # noqa: E402
from flashdraft.engine import policy as policy_module  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402

SETS = {"held-out": ["default"], "out-of-domain": ["ood-code", "ood-code-nl"]}
POLICIES = ("adaptive", "fixed", "never", "no-lookup-steps", "no-trim")
FIRST_CYCLES = 4  # drafting cycles per request whose acceptance `first_cycles` reports


def parse_variant(text: str) -> tuple[str, dict[str, float]]:
    """`NAME:CONSTANT=VALUE,...` -> (NAME, {CONSTANT: value}); only numeric constants the policy module has."""
    name, _, assignments = text.partition(":")
    if not name or name in POLICIES or name in ("plain", "compare") or not assignments:
        raise ValueError(f"--variant {text!r}: expected NAME:CONSTANT=VALUE[,CONSTANT=VALUE] with a new NAME")
    values = {}
    for item in assignments.split(","):
        key, _, value = item.partition("=")
        current = getattr(policy_module, key, None)
        if not key.isupper() or isinstance(current, bool) or not isinstance(current, (int, float)):
            raise ValueError(f"--variant {text!r}: {key!r} is not a numeric constant of flashdraft.engine.policy")
        try:
            values[key] = type(current)(float(value)) if isinstance(current, float) else int(value)
        except ValueError:
            raise ValueError(f"--variant {text!r}: {key} needs a {type(current).__name__}, got {value!r}") from None
    return name, values


@contextlib.contextmanager
def policy_constants(values: dict[str, float]):
    """The policy module's constants set to `values` inside the block (read when the policy runs)."""
    saved = {k: getattr(policy_module, k) for k in values}
    for k, v in values.items():
        setattr(policy_module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(policy_module, k, v)


class NeverDraft:
    """A draft policy whose every width is 1: one-token steps through the drafting engine."""

    def new_row(self, sampled: bool = False) -> None:
        return None

    def widths(self, rows: list, pending: list[int] | None = None) -> list[int]:
        return [1] * len(rows)

    def observe(self, rows, widths, accepted, timing) -> None:
        pass


# EngineConfig fields every engine built here takes (`--cudnn-attention`)
ENGINE_OPTIONS: dict = {}


def build_engine(target, tokenizer, drafter, policy: str | None, mixed_prefill_tokens: int = 512) -> SpecEngine:
    if policy is None:
        return SpecEngine(target, None, tokenizer, mixed_prefill_tokens=mixed_prefill_tokens, **ENGINE_OPTIONS)
    engine = SpecEngine(target, drafter, tokenizer, EngineConfig(
        draft_policy="fixed" if policy == "fixed" else "adaptive", mixed_prefill_tokens=mixed_prefill_tokens,
        lookup_steps=0 if policy == "no-lookup-steps" else EngineConfig.lookup_steps,
        confidence_trim=policy != "no-trim", **ENGINE_OPTIONS))
    if policy == "never":
        open_batch = engine._new_batch

        def never_batch(**fields):
            batch = open_batch(**fields)
            batch.policy = NeverDraft()
            return batch

        engine._new_batch = never_batch
    return engine


@dataclass
class Served:
    """What one engine's pass over the queue gave: output tokens, the seconds its steps took, tau per drafting
    request and its first drafting cycles' acceptance lengths."""

    tokens: int = 0
    seconds: float = 0.0
    taus: list = field(default_factory=list)
    firsts: list = field(default_factory=list)


@torch.inference_mode()
def request_lengths(spec: str, count: int) -> list[int]:
    """Per request, its max_tokens: `spec` "N" for all, or "LO-HI" drawn uniformly per request (seeded by index)."""
    lo, _, hi = spec.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"--max-tokens {spec!r}: expected N or LO-HI with 1 <= LO <= HI")
    return [random.Random(i).randint(lo, hi) for i in range(count)]


def serving(engine: SpecEngine, prompts: list[list[int]], concurrency: int, max_tokens, temperature: float,
            served: Served, finished: list | None = None, top_p: float = 1.0, top_k: int = 0):
    """Serve the queue `concurrency` at a time, yielding after every engine step; `served` adds up what each step
    gave and took (wall time of the step: admission, `SpecEngine.step`, the finished requests' bookkeeping), and
    every request's result is appended to `finished`, if given."""
    queue = list(enumerate(prompts))
    batch = engine.open_batch()
    while queue or batch.rows:
        started = time.perf_counter()
        joining = [queue.pop(0) for _ in range(min(len(queue), concurrency - len(batch.rows)))]
        # all that join in one call, as the server admits them: their prompts ride the running rows' cycle
        # (`SpecEngine.step`), or, in an empty batch or where the engine cannot mix them in, one prefill first
        params = [SamplingParams(max_new_tokens=max_tokens if isinstance(max_tokens, int) else max_tokens[i],
                                 temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=i if temperature > 0 else None) for i, _ in joining]
        events = engine.step(batch, [prompt for _, prompt in joining], params,
                             request_ids=[i for i, _ in joining]) if joining else engine.step(batch)
        for event in events:
            if event.finished:
                if finished is not None:
                    finished.append(event.result)
                served.tokens += len(event.result.token_ids)
                lengths = event.result.stats.acceptance_lengths
                if lengths:
                    served.taus.append(sum(lengths) / len(lengths))
                    served.firsts.append(lengths[:FIRST_CYCLES])
        served.seconds += time.perf_counter() - started
        yield


def serve(engine: SpecEngine, prompts: list[list[int]], concurrency: int, max_tokens: int,
          temperature: float, finished: list | None = None, top_p: float = 1.0,
          top_k: int = 0) -> tuple[int, float, list[float], list[list[int]]]:
    """(output tokens, seconds, tau per drafting request, first drafting cycles' acceptance lengths per drafting
    request) of the queue served `concurrency` at a time by one engine alone (`serving`)."""
    served = Served()
    for _ in serving(engine, prompts, concurrency, max_tokens, temperature, served, finished, top_p, top_k):
        pass
    return served.tokens, served.seconds, served.taus, served.firsts


def shipped_pair(set_name: str = "default", num_prompts: int = 32, threads: int = 1):
    """(target, tokenizer, drafter, the set's first prompts as token ids): the shipped pair on CPU, `threads` torch
    threads, for the diagnostic scripts beside the benchmark records (docs/bench/*)."""
    torch.set_num_threads(threads)
    target, tokenizer, drafter = load_pair(None, None, "cpu", None)
    return target, tokenizer, drafter, [tokenizer.encode(q.text) for q in load_prompts(set_name, num_prompts)]


def set_prompts(tokenizer, name: str, num_prompts: int) -> list[list[int]]:
    """A set's first prompts as token ids: `num_prompts` shared evenly by its datasets (at least one of each)."""
    per = max(1, num_prompts // len(SETS[name]))
    return [tokenizer.encode(q.text) for spec in SETS[name] for q in load_prompts(spec, per)]


def warm(engine: SpecEngine, prompts: list[list[int]], concurrency: int, temperature: float, top_p: float = 1.0,
         top_k: int = 0) -> None:
    """As `flashdraft serve` does before its first request (`SpecEngine.warmup`), and a short untimed pass: plain
    decoding's warmup runs nothing, so the first engine timed would carry the first launches (on an H100, `never`
    ran 1.46-4.17x plain decoding without it)."""
    engine.warmup(concurrency)
    serve(engine, prompts[:concurrency], concurrency, 8, temperature, None, top_p, top_k)


def tally_cycles(trace: list[dict], kind) -> dict[str, list]:
    """Cycle-trace records (`SpecEngine.cycle_trace`) grouped by `kind(record)`: {kind: [cycles, tokens committed,
    ms, rows]}."""
    kinds = defaultdict(lambda: [0, 0, 0.0, 0])
    for c in trace:
        k = kinds[kind(c)]
        k[0] += 1
        k[1] += len(c["requests"]) + sum(c["accepted"])
        k[2] += c["ms"]
        k[3] += len(c["requests"])
    return dict(kinds)


def print_tally(kinds: dict[str, list], order=None) -> None:
    for label, (n, tokens, ms, rows) in sorted(kinds.items(), key=order):
        print(f"  {label:28s} {n:4d} cycles {rows / n:5.1f} rows {tokens:5d} tokens {ms:7.0f} ms "
              f"{tokens / ms:.2f} tokens/ms")


def serve_lockstep(engines: dict[str, SpecEngine], prompts: list[list[int]], concurrency: int, max_tokens: int,
                   temperature: float, constants: dict[str, dict] | None = None,
                   served: dict[str, Served] | None = None, top_p: float = 1.0, top_k: int = 0) -> dict[str, Served]:
    """Every engine serves the same queue at once, one step each in turn (the order reversed every turn), each
    timed by its own steps (with its policy constants, `--variant`, set around each of them): a slowdown of the
    shared machine lasting longer than a few steps falls on all of them alike instead of on whichever pass it
    met. What each gave is added to `served` (new totals if None), which is returned."""
    served = served if served is not None else {key: Served() for key in engines}
    passes = [(key, serving(engine, prompts, concurrency, max_tokens, temperature, served[key], top_p=top_p,
                            top_k=top_k))
              for key, engine in engines.items()]
    turn = 0
    while passes:
        for key, one in passes[::-1] if turn % 2 else list(passes):
            try:
                with policy_constants((constants or {}).get(key, {})):
                    next(one)
            except StopIteration:
                passes.remove((key, one))
        turn += 1
    return served


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--sets", default=",".join(SETS), help=f"prompt sets among {list(SETS)}")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per set")
    p.add_argument("--max-tokens", default="64", help="new tokens per request: N, or LO-HI (per request, seeded)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0,
                   help="every request's top-p (the settings users serve: 0.9-0.95)")
    p.add_argument("--top-k", type=int, default=0, help="every request's top-k (0: off)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", default="adaptive,never", help=f"comma-separated among {POLICIES}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (the pair in the device's default dtype)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default: the device's: fp32 on CPU, bf16 on GPU; bf16 on a CPU with AMX "
                        "makes the target's matmuls cheap and its steps overhead-bound, as on a GPU)")
    p.add_argument("--compare-draft", default=None, help="another drafter, run with the default policy")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:CONSTANT=VALUE[,...]: the default policy with flashdraft.engine.policy constants set")
    p.add_argument("--apart", action="store_true",
                   help="two more engines whose joining prompts are prefilled apart (mixed_prefill_tokens=0): "
                        "plain decoding (`plain_apart`) and the default policy (`adaptive_apart`)")
    p.add_argument("--json", default=None)
    p.add_argument("--lockstep", action="store_true",
                   help="the engines serve each round's queue at once, one step each in turn, each timed by its own "
                        "steps: the machine's slow spells fall on every engine alike")
    p.add_argument("--warm-full", action="store_true",
                   help="serve the whole queue once, untimed, with every engine first: on a GPU with cuDNN attention "
                        "the first engine to meet a shape pays its plan, and plain decoding runs first")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="let the engines' attention take cuDNN's SDPA backend too (left out by default on CUDA: it "
                        "plans a graph per new shape; flashdraft/engine/kernels.py)")
    args = p.parse_args(argv)
    ENGINE_OPTIONS["cudnn_attention"] = args.cudnn_attention
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    policies = args.policies.split(",")
    unknown = [x for x in policies if x not in POLICIES] + [s for s in args.sets.split(",") if s not in SETS]
    if unknown or min(concurrencies) < 1 or args.rounds < 1 or args.num_prompts < 1:
        p.error(f"bad value(s): {unknown or 'concurrency, rounds and num-prompts must be >= 1'}")
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as e:
        p.error(str(e))
    if len(variants) < len(args.variant):
        p.error("--variant names must differ")
    try:
        request_lengths(args.max_tokens, 1)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_pair(None, None, args.device, args.dtype)
    other = load_pair(None, args.compare_draft, args.device, args.dtype)[2] if args.compare_draft else None
    columns = (policies + (["compare"] if other is not None else []) + list(variants)
               + (["plain_apart", "adaptive_apart"] if args.apart else []))
    rows = []
    print(f"| set | conc | {' | '.join(columns)} |  (DFlash / plain decoding tokens/s, mean tau per request)")
    print("|---|---|" + "---|" * len(columns))
    for name in args.sets.split(","):
        prompts = set_prompts(tokenizer, name, args.num_prompts)
        lengths = request_lengths(args.max_tokens, len(prompts))
        for concurrency in concurrencies:
            engines = {"plain": build_engine(target, tokenizer, drafter, None),
                       **{x: build_engine(target, tokenizer, drafter, x) for x in policies}}
            if other is not None:
                engines["compare"] = build_engine(target, tokenizer, other, "adaptive")
            if args.apart:
                engines["plain_apart"] = build_engine(target, tokenizer, drafter, None, mixed_prefill_tokens=0)
                engines["adaptive_apart"] = build_engine(target, tokenizer, drafter, "adaptive",
                                                         mixed_prefill_tokens=0)
            for variant, values in variants.items():  # built under its constants: some are read at construction
                with policy_constants(values):
                    engines[variant] = build_engine(target, tokenizer, drafter, "adaptive")
            for key, engine in engines.items():
                with policy_constants(variants.get(key, {})):
                    warm(engine, prompts, concurrency, args.temperature, args.top_p, args.top_k)
                    if args.warm_full:  # every shape of the timed queue seen once (a GPU plans each new one)
                        serve(engine, prompts, concurrency, lengths, args.temperature, None, args.top_p,
                              args.top_k)
            totals = {k: Served() for k in engines}  # summed over rounds
            for r in range(args.rounds):
                if args.lockstep:
                    serve_lockstep(engines, prompts, concurrency, lengths, args.temperature, variants, totals,
                                   args.top_p, args.top_k)
                    continue
                for key, engine in list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]:
                    with policy_constants(variants.get(key, {})):
                        for _ in serving(engine, prompts, concurrency, lengths, args.temperature,
                                         totals[key], top_p=args.top_p, top_k=args.top_k):
                            pass
            plain = totals["plain"].tokens / totals["plain"].seconds
            cell = {"set": name, "concurrency": concurrency, "plain_tok_s": round(plain, 1)}
            shown = []
            for key in columns:
                x = totals[key]
                n, seconds = x.tokens, x.seconds
                tau = sum(x.taus) / len(x.taus) if x.taus else 1.0
                first_cycles = [[f[i] for f in x.firsts if len(f) > i] for i in range(FIRST_CYCLES)]
                cell[key] = {"ratio": round(n / seconds / plain, 3), "tok_s": round(n / seconds, 1),
                             "tau": round(tau, 2),
                             "first_cycles": [round(sum(c) / len(c), 2) if c else None for c in first_cycles]}
                shown.append(f"{n / seconds / plain:.2f}x ({tau:.2f})")
            if args.apart:  # joins prefilled apart on both sides: DFlash against plain decoding as before
                cell["adaptive_apart"]["ratio_vs_plain_apart"] = round(
                    cell["adaptive_apart"]["tok_s"] / cell["plain_apart"]["tok_s"], 3)
                shown.append(f"apart: {cell['adaptive_apart']['ratio_vs_plain_apart']:.2f}x")
            rows.append(cell)
            print(f"| {name} | {concurrency} | " + " | ".join(shown) + " |", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "variants": variants, "cells": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
