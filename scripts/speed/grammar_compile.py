"""What a structured request costs the thread that builds its matcher: compiling its constraint against copying a
compiled one (`GrammarCompiler`), for the constraints of `structured_cost.py` and a larger JSON schema.

    python scripts/speed/grammar_compile.py [--target DIR] [--reps 20]

Prints the median ms of a compile (a fresh compiler's first matcher for the spec, its tokenizer view already built)
and of a matcher taken from the compiled spec.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "speed"))

from structured_cost import CONSTRAINTS  # noqa: E402

from flashdraft.engine.structured import GrammarCompiler, StructuredOutput  # noqa: E402

LARGE_SCHEMA = {"type": "object", "required": [f"field_{i}" for i in range(10)], "properties": {
    f"field_{i}": {"type": ["string", "integer", "array"], "items": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "[a-z]{2,8}"}, "b": {"enum": ["x", "y", "z"]}}}} for i in range(30)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "flashdraft" / "assets" / "default_pair" / "target"))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    eos = [tok.eos_token_id]
    tokenizer_view = GrammarCompiler(tok, len(tok), eos).tokenizer()
    specs = {**{k: v for k, v in CONSTRAINTS.items() if v is not None}, "json_schema_30_fields": StructuredOutput(json_schema=LARGE_SCHEMA)}
    print(f"| constraint | compile, ms | copy, ms | vocabulary {len(tok)} |\n|---|---|---|---|")
    for name, spec in specs.items():
        compiles, copies = [], []
        for _ in range(args.reps):
            compiler = GrammarCompiler(tok, len(tok), eos)
            compiler._tokenizer = tokenizer_view  # built once above: its ~0.1-1 s is paid at the first request only
            start = time.perf_counter()
            compiler.matcher(spec)
            middle = time.perf_counter()
            compiler.matcher(spec)
            compiles.append(middle - start)
            copies.append(time.perf_counter() - middle)
        print(f"| {name} | {1e3 * statistics.median(compiles):.3f} | {1e3 * statistics.median(copies):.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
