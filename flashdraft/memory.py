"""KV-cache memory at real model sizes: bytes per cache position, what a batch reserves, rows that fit a budget.

The engine's reservation rule (flashdraft.engine.generate, `cache_capacity`): a row needs
`cache_capacity(prompt + max_new_tokens + block)` positions, a power of two of at least 256, reserved up front; a
batch holds every row at its largest row's capacity (rows join and leave; the batch shrinks when its longest row
leaves), with power-of-two row counts when compiled (`RowBuckets`). Each position costs:
- target K/V: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes;
- drafter context K/V: the same over the drafter's layers (its cache holds one scratch slot more per row).
`reserved_positions` and `positions_for_budget` turn that into the server's admission figure
(`--kv-cache-memory`, scheduler.py); `REAL_SHAPES` holds the configs of Qwen3-8B and Llama-3.1-70B (written out
here: no hub access) for `scripts/memory/project.py`.

What this module does not know about: activations, the prefill's transient buffers, the features queued between
cycles, the allocator's fragmentation (keep a margin), and caches that grow with the tokens held (the engine
reserves up front; see docs/design.md, 'Memory').
"""

from __future__ import annotations

import torch

GiB = 1024**3

# config.json fields of real targets (published configs, copied by hand), for building them on the meta device
REAL_SHAPES = {
    "Qwen3-8B": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Llama-3.1-70B": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}


def real_config(name: str):
    """A transformers config of one of `REAL_SHAPES` (no weights, no hub access)."""
    from transformers import AutoConfig

    fields = dict(REAL_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def kv_bytes_per_position(config, dtype: torch.dtype) -> int:
    """K and V bytes of one cache position over every layer of a model with this (text) config."""
    tc = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    return 2 * tc.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def engine_bytes_per_position(engine) -> tuple[int, int]:
    """(target, drafter) K/V bytes per cache position of a SpecEngine (drafter 0 without a drafting model)."""
    target = kv_bytes_per_position(engine.target.config, engine.target.dtype)
    drafter = getattr(engine, "drafter", None)
    config = getattr(drafter, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return target, 0
    dtype = getattr(drafter, "dtype", engine.target.dtype)
    return target, kv_bytes_per_position(config, dtype)


def row_capacity(prompt_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """Cache positions the engine reserves for one row (its rule, imported: the figures cannot drift from it)."""
    from flashdraft.engine.generate import cache_capacity

    return cache_capacity(prompt_tokens + max_new_tokens + block_size)


def reserved_positions(capacities: list[int], cache_rows=lambda n: n) -> int:
    """Positions a static batch of rows with these capacities holds: every row (and every padding row
    `cache_rows(n)` adds for compiled row buckets) at the largest capacity, plus the drafter's scratch slot."""
    if not capacities:
        return 0
    return cache_rows(len(capacities)) * (max(capacities) + 1)


def positions_for_budget(budget_bytes: int, target_bytes: int, drafter_bytes: int) -> int:
    """Cache positions (target and drafter K/V together) that `budget_bytes` holds."""
    return int(budget_bytes // max(1, target_bytes + drafter_bytes))


def rows_that_fit(budget_bytes: int, prompt_tokens: int, max_new_tokens: int, block_size: int, target_bytes: int,
                  drafter_bytes: int) -> int:
    """Rows of this length a budget holds under the engine's reservation rule (uncompiled: no padding rows)."""
    per_row = row_capacity(prompt_tokens, max_new_tokens, block_size) + 1
    return positions_for_budget(budget_bytes, target_bytes, drafter_bytes) // per_row


def batch_kv_bytes(batch) -> int:
    """Bytes of the K/V tensors a live engine batch holds: the target's static cache and the drafter's context
    cache (the measured side of the reservation rule; reads the batch's `kv` and `proposer_state.kv`)."""
    total = 0
    for state in (batch.kv, batch.proposer_state):
        kv = getattr(state, "kv", None)
        if kv is not None:
            total += sum(t.numel() * t.element_size() for t in kv.keys + kv.values)
    return total


def memory_budget_arg(text: str) -> tuple[str, float]:
    """`--kv-cache-memory`: "24" or "24GiB" (GiB), or "90%" (of the device's memory: `resolve_memory_budget`)."""
    import argparse
    import math

    value = text.strip()
    kind = "percent" if value.endswith("%") else "GiB"
    number = value.rstrip("%") if kind == "percent" else value.removesuffix("GiB").removesuffix("G")
    try:
        amount = float(number)
    except ValueError:
        amount = float("nan")
    if not math.isfinite(amount) or amount <= 0 or (kind == "percent" and amount > 100):
        raise argparse.ArgumentTypeError(f"expected GiB (e.g. 24 or 24GiB) or a percentage of the device's memory "
                                         f"(e.g. 90%), got {text!r}")
    return kind, amount


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of the device: CUDA's own figures, or on CPU the machine's RAM and this process's RSS."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total, rss


def resolve_memory_budget(spec: tuple[str, float], device: torch.device) -> int:
    """Bytes of K/V budget: GiB as given, or P% of the device's memory less what is in use already (the weights:
    vLLM's `gpu_memory_utilization` reading). Refused when nothing is left."""
    kind, amount = spec
    if kind == "GiB":
        return int(amount * GiB)
    total, used = device_memory(device)
    budget = int(total * amount / 100) - used
    if budget <= 0:
        raise ValueError(f"--kv-cache-memory {amount:g}%: {amount:g}% of {total / GiB:.1f} GiB leaves nothing for the "
                         f"KV cache beside the {used / GiB:.1f} GiB in use (weights); raise it or give GiB")
    return budget


def describe(target_bytes: int, drafter_bytes: int, budget_bytes: int | None, tokens: int, block_size: int) -> str:
    """One line: bytes per position, what a row of `tokens` (prompt + max_tokens) reserves, and how many such rows
    the budget holds (what `flashdraft serve` logs at start-up, for a row using the whole context)."""
    capacity = row_capacity(tokens, 0, block_size)
    per_row = (capacity + 1) * (target_bytes + drafter_bytes)
    text = (f"KV cache: {target_bytes / 1024:.1f} KiB (target) + {drafter_bytes / 1024:.1f} KiB (drafter) per "
            f"position; a row of {tokens} tokens (prompt + max_tokens) reserves {capacity} positions "
            f"= {per_row / GiB:.3f} GiB")
    if budget_bytes is not None:
        fit = rows_that_fit(budget_bytes, tokens, 0, block_size, target_bytes, drafter_bytes)
        positions = positions_for_budget(budget_bytes, target_bytes, drafter_bytes)
        text += f"; the budget of {budget_bytes / GiB:.3f} GiB holds {positions} positions = {fit} such rows"
    return text
