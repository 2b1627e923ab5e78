"""What prompt lookup could give at the draft policy's one-token steps: the engine at batch 1, greedy, the default
policy with lookup steps off (the steps as the drafter's policy leaves them), and at every one-token step the
continuation `NgramIndex` finds from the row's tokens so far, compared with the tokens the target went on to commit.

    python scripts/speed/lookup_potential.py [--datasets ood-code,ood-code-nl,default] [--num-prompts 32]
        [--max-new-tokens 128] [--min-ngram 2,3,4]

Prints per dataset: tokens, one-token steps, drafting cycles, and per minimum n-gram the steps with a continuation
and the continuation tokens the target would have accepted (their matching prefix). An upper bound of what
`--lookup-steps` adds: accepted continuations change the steps that follow, and the policy verifies a
continuation only as far as it prices it worth verifying.

What this script does not know about: time (it counts tokens).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.reference import first_difference  # noqa: E402
from flashdraft.engine import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.engine.lookup import NgramIndex  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402


def accepted_prefix(continuation: list[int], committed: list[int]) -> int:
    """How many of the continuation's tokens the target committed next (their matching prefix)."""
    first = first_difference(continuation, committed)
    return len(continuation) if first is None else first


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="ood-code,ood-code-nl,default")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--min-ngram", default="2,3,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    minimums = [int(n) for n in args.min_ngram.split(",")]
    target, tokenizer, drafter = load_pair()
    engine = SpecEngine(target, drafter, tokenizer, lookup_steps=0)
    engine.warmup()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    for name in args.datasets.split(","):
        counts = {"tokens": 0, "one_token_steps": 0, "drafting_cycles": 0}
        found = {n: {"steps_with_continuation": 0, "accepted": 0} for n in minimums}
        for prompt in load_prompts(name, args.num_prompts):
            ids = prompt.encode(tokenizer, False)
            trace: list[dict] = []
            engine.cycle_trace = trace.append
            out = engine.generate([ids], params)[0].token_ids
            counts["tokens"] += len(out)
            position = 1  # the prefill committed the first token; a cycle starts after output[:position]
            for cycle in trace:
                width, accepted = cycle["widths"][0], cycle["accepted"][0]
                if width == 1:
                    counts["one_token_steps"] += 1
                    for n in minimums:
                        index = NgramIndex(n)
                        index.extend(ids, out[:position])
                        continuation = index.continuation(engine.block_size - 1)
                        found[n]["steps_with_continuation"] += bool(continuation)
                        found[n]["accepted"] += accepted_prefix(continuation, out[position:])
                else:
                    counts["drafting_cycles"] += 1
                position += accepted + 1
        print(json.dumps({"dataset": name, **counts, **{f"min_ngram_{n}": v for n, v in found.items()}}), flush=True)


if __name__ == "__main__":
    main()
