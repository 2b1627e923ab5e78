"""Plain decoding of a random Qwen3-MoE target through the engine's two target paths, interleaved rounds: the fast
path (paged cache, lean forward, the model's own sparse blocks) against transformers' own forward (DynamicCache).
Each path's output is checked against the target's greedy `generate`.

    python docs/bench/moe_fast_path/moe_paths.py [--rounds 3] [--batch 1,4] [--threads 1]
"""

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from flashdraft import SamplingParams, SpecEngine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_experts=16, num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, bos_token_id=None,
                            eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    target = Qwen3MoeForCausalLM(config).eval()
    print(f"Qwen3-MoE {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters, "
          f"experts: {target.config._experts_implementation}, torch threads {args.threads}")
    params = SamplingParams(max_new_tokens=args.new_tokens)
    results = {}
    for batch in map(int, args.batch.split(",")):
        prompts = torch.randint(0, 4095, (batch, args.prompt_tokens)).tolist()
        expected = [target.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, do_sample=False,
                                    pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        engines = {"fast": SpecEngine(target, fast_path=True), "generic": SpecEngine(target, fast_path=False)}
        rates = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                start = time.perf_counter()
                out = engine.generate(prompts, params)
                rates[name].append(batch * args.new_tokens / (time.perf_counter() - start))
                assert [r.token_ids for r in out] == expected, f"{name} path differs from generate"
        med = {name: statistics.median(r) for name, r in rates.items()}
        results[batch] = {"tokens_per_s": rates, "fast_over_generic": med["fast"] / med["generic"]}
        print(f"batch {batch}: fast {med['fast']:.1f} tok/s, generic {med['generic']:.1f} tok/s, "
              f"{med['fast'] / med['generic']:.2f}x (rounds {[round(x, 1) for x in rates['fast']]} / "
              f"{[round(x, 1) for x in rates['generic']]}); outputs equal generate")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
