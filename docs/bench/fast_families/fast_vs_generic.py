"""Plain decoding of the newly fast families through both target paths (kept as run): randomly initialised models of
the shipped target's shape (hidden 256, 4 layers, 4 heads / 2 KV heads of 64, vocab 8192, fp32), 64 new tokens after
96-token prompts, one thread, the two engines interleaved over rounds; tokens/s per path and their ratio. With
`--speculative`: speculative decoding instead, drafts from the tests' oracle (`tests/tiny.py`: the target's own
greedy continuation with 40 % of the tokens corrupted), every cycle the full block of 8 (`draft_policy="fixed"`),
so both paths verify the same blocks and roll back the same rejections.

    python docs/bench/fast_families/fast_vs_generic.py [--rounds 3] [--batch 1,4] [--speculative] [--families gpt-oss]
"""
import argparse, statistics, sys, time
from pathlib import Path

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          GptOssConfig, GptOssForCausalLM, Phi3Config, Phi3ForCausalLM)

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from flashdraft import SamplingParams, SpecEngine  # noqa: E402
from tiny import OracleProposer  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {
    "llama (fast before)": (LlamaForCausalLM, lambda: LlamaConfig(**SHAPE)),
    "phi3 (window 128)": (Phi3ForCausalLM, lambda: Phi3Config(sliding_window=128, **SHAPE)),
    "phi4-mini (LongRoPE, 3/4 rotary)": (Phi3ForCausalLM, lambda: Phi3Config(
        partial_rotary_factor=0.75, original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 24,
                         "long_factor": [1.0 + i / 4 for i in range(24)]},
        **{**SHAPE, "max_position_embeddings": 131072})),
    "gemma": (GemmaForCausalLM, lambda: GemmaConfig(**SHAPE)),
    "gemma2 (window 128, caps)": (Gemma2ForCausalLM, lambda: Gemma2Config(sliding_window=128, query_pre_attn_scalar=64,
                                                                         **SHAPE)),
    "gemma3 (window 128)": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        sliding_window=128, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"], **SHAPE)),
    "mistral (window 128)": (MistralForCausalLM, lambda: MistralConfig(sliding_window=128, **SHAPE)),
    "gpt-oss (window 128, 8 experts, 2 a token)": (GptOssForCausalLM, lambda: GptOssConfig(
        sliding_window=128, num_local_experts=8, num_experts_per_tok=2, intermediate_size=384,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        layer_types=["sliding_attention", "full_attention"] * 2, **{k: v for k, v in SHAPE.items()
                                                                    if k != "intermediate_size"})),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--speculative", action="store_true")
    ap.add_argument("--families", default=None, help="comma-separated name prefixes (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    params = SamplingParams(max_new_tokens=64)
    print("| family | batch | fast path tok/s | generic path tok/s | fast / generic | same tokens |")
    print("|---|---|---|---|---|---|")
    for name, (cls, config) in FAMILIES.items():
        if args.families and not any(name.startswith(f) for f in args.families.split(",")):
            continue
        torch.manual_seed(0)
        model = cls(config()).float().eval()
        for batch in map(int, args.batch.split(",")):
            prompts = [torch.randint(0, 8000, (96,), generator=torch.Generator().manual_seed(r)).tolist()
                       for r in range(batch)]
            if args.speculative:
                refs = [p + r.token_ids for p, r in zip(prompts, SpecEngine(model).generate(prompts, params))]
                engines = {key: SpecEngine(model, block_size=8, draft_policy="fixed", fast_path=fast,
                                           proposer=OracleProposer(refs, vocab=8192, seed=1))
                           for key, fast in (("fast", None), ("generic", False))}
            else:
                engines = {"fast": SpecEngine(model), "generic": SpecEngine(model, fast_path=False)}
            assert engines["fast"].fast is not None and engines["generic"].fast is None
            speed, outputs = {k: [] for k in engines}, {}
            for r in range(args.rounds + 1):  # the first round warms up, untimed
                for key in (engines if r % 2 else list(engines)[::-1]):
                    start = time.perf_counter()
                    results = engines[key].generate(prompts, params)
                    seconds = time.perf_counter() - start
                    outputs[key] = [res.token_ids for res in results]
                    if r:
                        speed[key].append(sum(map(len, outputs[key])) / seconds)
            fast, generic = statistics.median(speed["fast"]), statistics.median(speed["generic"])
            print(f"| {name} | {batch} | {fast:.0f} | {generic:.0f} | {fast / generic:.2f}x | "
                  f"{outputs['fast'] == outputs['generic']} |", flush=True)


if __name__ == "__main__":
    main()
