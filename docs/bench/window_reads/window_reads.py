"""Sliding-window layers reading only the pages their window reaches, against reading every position (the code
before, restored in the same process by patching `FastTarget._window_starts` to start every read at 0), kept as
run. Randomly initialised models of the shipped target's shape (hidden 256, 4 layers, 4 heads / 2 KV heads of 64,
vocab 8192, fp32) with 128-token windows, prompts of `--contexts` tokens, one thread, the two ways interleaved
over rounds. Decoding time only: the tokens each row streams after its first ones (which come with the prompts'
prefill) over the time from the first streamed tokens to the end. Plain decoding, or with `--speculative` the
tests' oracle drafts (`tests/tiny.py`: the target's own greedy continuation with 40 % of the tokens corrupted),
every cycle the full block of 8 (`draft_policy="fixed"`). Both ways must give the same tokens.

    python docs/bench/window_reads/window_reads.py [--rounds 3] [--batch 1,4] [--contexts 1024,4096] [--new 48]
        [--speculative] [--families mistral,gemma3]
"""
import argparse, statistics, sys, time
from pathlib import Path

import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, MistralConfig,
                          MistralForCausalLM)

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fast_families"))
import fast_vs_generic  # noqa: E402
from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from flashdraft.model.fast_target import FastTarget  # noqa: E402
from tiny import OracleProposer  # noqa: E402

SHAPE = {**fast_vs_generic.SHAPE, "max_position_embeddings": 8192}  # the shipped target's shape, longer contexts
FAMILIES = {
    "mistral": ("every layer a 128-token window", MistralForCausalLM, lambda: MistralConfig(sliding_window=128, **SHAPE)),
    "gemma3": ("3 of 4 layers a 128-token window", Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        sliding_window=128, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"], **SHAPE)),
    "gpt-oss": ("1 of 2 layers a 128-token window, 8 experts", GptOssForCausalLM, lambda: GptOssConfig(
        sliding_window=128, num_local_experts=8, num_experts_per_tok=2, intermediate_size=384,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        layer_types=["sliding_attention", "full_attention"] * 2, **{k: v for k, v in SHAPE.items()
                                                                    if k != "intermediate_size"})),
}
WINDOW_STARTS = FastTarget._window_starts


def random_model(family: str):
    """(what its windows are, the family's model with seeded random weights, fp32)."""
    what, cls, config = FAMILIES[family]
    torch.manual_seed(0)
    return what, cls(config()).float().eval()


def random_prompts(rows: int, length: int) -> list[list[int]]:
    """`rows` prompts of `length` random token ids, prompt r seeded by r."""
    return [torch.randint(0, 8000, (length,), generator=torch.Generator().manual_seed(r)).tolist()
            for r in range(rows)]


def every_position(self, positions, kv, exact):
    return dict.fromkeys(self.windows, 0)


def timed(engine, prompts, tokens, full_reads: bool) -> tuple[float, int, list]:
    """(seconds from the first streamed tokens to the end, tokens decoded in them, every row's tokens)."""
    FastTarget._window_starts = every_position if full_reads else WINDOW_STARTS
    try:
        first, produced, results, seen = None, 0, [None] * len(prompts), set()
        for event in engine.stream(prompts, SamplingParams(max_new_tokens=tokens)):
            first = first or time.perf_counter()
            if event.index in seen:  # a row's first tokens came with its prefill
                produced += len(event.token_ids)
            seen.add(event.index)
            if event.finished:
                results[event.index] = event.result.token_ids
        return time.perf_counter() - first, produced, results
    finally:
        FastTarget._window_starts = WINDOW_STARTS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--speculative", action="store_true")
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'speculative (oracle, fixed blocks of 8)' if args.speculative else 'plain decoding'}, decoding "
          f"tokens/s after the prefill ({args.new} new tokens a row), median of {args.rounds} rounds\n")
    print("| family | context | batch | window reads | every position | ratio | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        what, model = random_model(family)
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batch.split(",")):
                prompts = random_prompts(batch, context)
                if args.speculative:
                    refs = [p + r.token_ids for p, r in
                            zip(prompts, SpecEngine(model).generate(prompts, SamplingParams(max_new_tokens=1 + args.new)))]
                    engine = SpecEngine(model, block_size=8, draft_policy="fixed",
                                        proposer=OracleProposer(refs, vocab=8192, seed=1))
                else:
                    engine = SpecEngine(model)
                assert engine.fast is not None
                speed, outputs = {False: [], True: []}, {}
                for r in range(args.rounds + 1):  # the first round warms up, untimed
                    for full in ((False, True) if r % 2 else (True, False)):
                        seconds, produced, outputs[full] = timed(engine, prompts, 1 + args.new, full)
                        if r:
                            speed[full].append(produced / seconds)
                ours, before = statistics.median(speed[False]), statistics.median(speed[True])
                print(f"| {family} ({what}) | {context} | {batch} | {ours:.1f} | {before:.1f} | "
                      f"**{ours / before:.2f}x** | {outputs[False] == outputs[True]} |", flush=True)


if __name__ == "__main__":
    main()
