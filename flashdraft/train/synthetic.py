"""Tiny targets and a synthetic corpus with learnable structure, for smoke tests and examples of the pipeline.

The corpus is arithmetic progressions: `[BOS, a, a+d, a+2d, ...] mod m` over token ids `first_token ..
first_token + m - 1`, with a few step sizes d. A tiny Qwen3 target trained on it for a few hundred steps continues
any progression greedily, so its own (regenerated) responses have structure a drafter can learn in seconds on CPU:
the drafter must infer d from the context features and add k*d to the anchor token.

What this module does not know about: real data; nothing here is used by the training pipeline itself.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

BOS = 1
MASK = 2
FIRST_TOKEN = 4


def tiny_target_config(vocab_size: int = 64, hidden_size: int = 64, num_layers: int = 4, heads: int = 4,
                       kv_heads: int = 2, intermediate_size: int = 128, max_positions: int = 256) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads, max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=0, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def progression(start: int, step: int, length: int, modulus: int, first_token: int = FIRST_TOKEN) -> list[int]:
    return [first_token + (start + i * step) % modulus for i in range(length)]


def arithmetic_corpus(n: int, length: int, vocab_size: int = 64, steps=(1, 2, 3), seed: int = 0,
                      first_token: int = FIRST_TOKEN) -> list[list[int]]:
    """n sequences `[BOS] + progression` of total length `length`."""
    g = torch.Generator().manual_seed(seed)
    modulus = vocab_size - first_token
    out = []
    for _ in range(n):
        a = int(torch.randint(modulus, (1,), generator=g))
        d = steps[int(torch.randint(len(steps), (1,), generator=g))]
        out.append([BOS] + progression(a, d, length - 1, modulus, first_token))
    return out


def train_tiny_target(config: Qwen3Config | None = None, steps: int = 300, batch_size: int = 32, length: int = 48,
                      lr: float = 3e-3, seed: int = 0) -> Qwen3ForCausalLM:
    """A tiny Qwen3 LM trained on `arithmetic_corpus` (plain next-token loss); returned in eval mode."""
    torch.manual_seed(seed)
    config = config or tiny_target_config()
    model = Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    for step in range(steps):
        batch = torch.tensor(arithmetic_corpus(batch_size, length, config.vocab_size, seed=seed * 100_003 + step))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()
