"""What a structured output costs and what drafting gives under one: the shipped pair, the held-out prompts under
each constraint (none, a regex, any JSON object, a JSON schema), through plain decoding, DFlash (the default policy)
and DFlash with its drafts left as the drafter made them (`SpecEngine._constrain_drafts` off: refused drafts are
simply rejected), in rotating order.

    python scripts/speed/structured_cost.py [--batch 1,16] [--num-prompts 32] [--max-tokens 64] [--rounds 2]
        [--temperature 0] [--threads 1] [--constraints none,regex,json_object,json_schema] [--draft DIR]

Per constraint and batch size: tokens per second of each engine, the drafting ones' ratio to plain decoding and
mean tau per request, the share of DFlash's time spent in the grammar (`RowGrammar.masks` and `.constrain`, timed
in place), and whether the engines produced the same tokens (seeded: they must, at any temperature; exit 1 if
not). The constrained outputs are other texts than the unconstrained ones, so compare tokens per second, not time
per request.

What this script does not know about: HTTP (the server runs the same engine), the reference check (the tests compare
constrained outputs with the target's own `generate` under the same mask).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

import engine_concurrency  # noqa: E402

from flashdraft.engine import SamplingParams, StructuredOutput  # noqa: E402
from flashdraft.engine.structured import RowGrammar  # noqa: E402
from flashdraft.loading import load_drafter  # noqa: E402

CONSTRAINTS = {
    "none": None,
    "regex": StructuredOutput(regex=r"[a-z_]+\([a-z_, ]*\)\n( {4}[a-z_]+ = [a-z_]+\([a-z_, ]*\)\n){1,8}"),
    "json_object": StructuredOutput(json_object=True),
    "json_schema": StructuredOutput(json_schema={
        "type": "object", "additionalProperties": False, "required": ["name", "args", "returns"],
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "args": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}},
                       "returns": {"enum": ["None", "int", "str", "list", "dict"]}}}),
}


class GrammarClock:
    """Times `RowGrammar.masks` and `RowGrammar.constrain` in place (seconds summed) while installed."""

    METHODS = ("masks", "constrain")

    def __init__(self):
        self.seconds, self._originals = 0.0, {name: getattr(RowGrammar, name) for name in self.METHODS}

    def __enter__(self):
        for name, method in self._originals.items():
            setattr(RowGrammar, name, self._timed(method))
        return self

    def _timed(self, method):
        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def __exit__(self, *exc):
        for name, method in self._originals.items():
            setattr(RowGrammar, name, method)


def run(engine, prompts, batch: int, params: SamplingParams):
    """(seconds, tokens, results) of the prompts in batches of `batch` rows."""
    start, results = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        results += engine.generate(prompts[i:i + batch], params)
    return time.perf_counter() - start, sum(len(r.token_ids) for r in results), results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--constraints", default=",".join(CONSTRAINTS), help="which of the script's constraints")
    p.add_argument("--draft", default=None, help="another drafter for the shipped target (default: the shipped one)")
    args = p.parse_args(argv)
    target, tokenizer, drafter, prompts = engine_concurrency.shipped_pair("default", args.num_prompts, args.threads)
    if args.draft:
        drafter = load_drafter(args.draft, dtype=drafter.dtype, device="cpu")
    engines = {"plain": engine_concurrency.build_engine(target, tokenizer, drafter, None),
               "dflash": engine_concurrency.build_engine(target, tokenizer, drafter, "adaptive"),
               "raw drafts": engine_concurrency.build_engine(target, tokenizer, drafter, "adaptive")}
    engines["raw drafts"]._constrain_drafts = lambda *args: None
    eos = tuple(engines["dflash"].eos_token_ids)
    print(f"temperature {args.temperature}, {len(prompts)} held-out prompts x <= {args.max_tokens} tokens, "
          f"{args.rounds} rounds, {args.threads} thread(s), drafter {args.draft or 'shipped'}")
    print("| constraint | rows | plain tok/s | DFlash tok/s | / plain | tau | raw drafts: tok/s | / plain | tau | "
          "grammar, share of DFlash's time | finished (stop) | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_same = True
    for batch in map(int, args.batch.split(",")):
        for engine in engines.values():
            engine_concurrency.warm(engine, prompts, batch, args.temperature)
        for name in args.constraints.split(","):
            spec = CONSTRAINTS[name]
            params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, seed=0,
                                    stop_token_ids=eos, structured=spec)
            seconds, tokens, outputs, mask_s = {k: 0.0 for k in engines}, {k: 0 for k in engines}, {}, 0.0
            for r in range(args.rounds):
                for kind in list(engines)[r % 3:] + list(engines)[:r % 3]:
                    with GrammarClock() as clock:
                        took, n, results = run(engines[kind], prompts, batch, params)
                    seconds[kind] += took
                    tokens[kind] += n
                    outputs.setdefault(kind, results)
                    if kind == "dflash":
                        mask_s += clock.seconds
            rate = {k: tokens[k] / seconds[k] for k in engines}
            texts = [[r.token_ids for r in outputs[k]] for k in engines]
            same = all(t == texts[0] for t in texts)
            all_same &= same  # seeded rows: plain decoding's text under any drafter
            tau = {k: statistics.mean(r.stats.tau for r in outputs[k]) for k in ("dflash", "raw drafts")}
            stopped = sum(r.finish_reason == "stop" for r in outputs["dflash"])
            cells = " | ".join(f"{rate[k]:.1f} | {rate[k] / rate['plain']:.2f}x | {tau[k]:.2f}"
                               for k in ("dflash", "raw drafts"))
            print(f"| {name} | {batch} | {rate['plain']:.1f} | {cells} | {100 * mask_s / seconds['dflash']:.1f} % | "
                  f"{stopped}/{len(prompts)} | {same} |")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
