"""KV-cache memory at real model sizes: bytes per cache position, what a batch holds, rows that fit a budget.

The engine's rule (flashdraft.engine.batch, `Batch.row_lengths`; flashdraft.model.slots, `PagedKV`): each row's
caches own pages (`kv_page_size` positions, 64 by default) for its committed tokens plus one block; pages come as
rows advance and go back when rows leave, and on the fast path a sliding-window layer's as they leave its window
(from a row's first cycle on: a prefill holds its whole prompt); padding rows of compiled row buckets own none; each
cache has one trash page. Each position costs:
- target K/V: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes;
- drafter context K/V: the same over the drafter's layers.
`held_positions` and `positions_for_budget` turn that into the server's admission and preemption figures
(`--kv-cache-memory`, scheduler.py), counting a windowed layer's positions at its share of a position's bytes
(`kv_shares`); `REAL_SHAPES` holds the configs of Qwen3-8B, Llama-3.1-70B and gpt-oss-20b (written out
here: no hub access) for `scripts/memory/project.py`.

What this module does not know about: activations, the prefill's transient buffers, the pages gathered for
attention (one layer at a time), a pool's free pages (it grows by an eighth when it runs out, never past the
budget's bytes, all pools together, and is compacted when a quarter is free), the transient copy when a pool grows or rows join, the
features pending between cycles, the allocator's fragmentation (keep a margin).
"""

from __future__ import annotations

import math

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
    "gpt-oss-20b": {  # every other layer slides over 128 positions
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "original_max_position_embeddings": 4096},
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


FULL_ATTENTION = ((1.0, None),)  # `kv_shares` of a model without sliding windows


def row_capacity(tokens: int, block_size: int, page_size: int, window: int | None = None) -> int:
    """Cache positions a row holding `tokens` committed tokens owns for its next cycle: one block more, in whole
    pages, less (layers sliding over `window`) the pages wholly before what its next queries see (the engine's
    rule, imported: the figures cannot drift from it)."""
    from flashdraft.engine.batch import chunked

    left = 0 if window is None else max(0, tokens - window + 1) // page_size * page_size
    return chunked(tokens + block_size, page_size) - left


def row_positions(tokens: int, block_size: int, page_size: int, shares=FULL_ATTENTION) -> float:
    """`row_capacity` over an engine's caches: `shares` ((share of the K/V bytes per position, window) per cache:
    `kv_shares`) counts a windowed cache's positions at its share of a whole position."""
    return sum(share * row_capacity(tokens, block_size, page_size, window) for share, window in shares)


def held_positions(row_tokens: list[int], block_size: int, page_size: int, shares=FULL_ATTENTION) -> int:
    """Positions a batch of rows holding these many committed tokens takes for its next cycle: each row's own
    pages (`row_positions`), plus the trash page of each cache."""
    if not row_tokens:
        return 0
    return math.ceil(sum(row_positions(t, block_size, page_size, shares) for t in row_tokens) + page_size - 1e-9)


def kv_shares(engine) -> tuple[tuple[float, int | None], ...]:
    """(share of a cache position's K/V bytes, window) per cache of a SpecEngine: the target's layers by their
    sliding window on the fast path (its windowed layers give pages back: `PagedKV.reserve`), full attention for
    the generic path's and the drafter's (a sliding drafter gives its pages back only when it next writes
    context, so they may lag the rule: counted whole)."""
    fast = getattr(engine, "fast", None)
    return window_shares(fast.windows if fast is not None else [None], *engine_bytes_per_position(engine))


def window_shares(windows: list[int | None], target: int, drafter: int) -> tuple[tuple[float, int | None], ...]:
    """`kv_shares` of a target whose layers slide over `windows` (None: full attention; `layer_windows`), with
    `target` / `drafter` K/V bytes per position."""
    by_window = {None: float(drafter)}
    for window in windows:
        by_window[window] = by_window.get(window, 0.0) + target / len(windows)
    return tuple((held / (target + drafter), window) for window, held in by_window.items() if held)


def positions_for_budget(budget_bytes: int, target_bytes: int, drafter_bytes: int) -> int:
    """Cache positions (target and drafter K/V together) that `budget_bytes` holds."""
    return int(budget_bytes // max(1, target_bytes + drafter_bytes))


def rows_that_fit(budget_bytes: int, tokens: int, block_size: int, page_size: int, target_bytes: int,
                  drafter_bytes: int, shares=FULL_ATTENTION) -> int:
    """Rows holding `tokens` tokens each (e.g. prompt + max_tokens: at their end) that a budget holds under the
    engine's rule (`shares`: `kv_shares`)."""
    positions = positions_for_budget(budget_bytes, target_bytes, drafter_bytes) - page_size
    return int(max(0, positions) // row_positions(tokens, block_size, page_size, shares))


def batch_kv_bytes(batch, held_only: bool = False) -> int:
    """Bytes of the K/V pools a live engine batch holds: the target's paged cache and the drafter's context
    cache (the measured side of the rule; reads the batch's `kv` and `proposer_state.kv`). `held_only`: the
    pages rows own plus the trash pages, without the pools' free pages."""
    total = 0
    for state in (batch.kv, batch.proposer_state):
        kv = getattr(state, "kv", None)
        if kv is not None:
            total += kv.pool_bytes(held_only)
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


def resolve_memory_budget(spec: tuple[str, float], device: torch.device, flag: str = "--kv-cache-memory") -> int:
    """Bytes of K/V budget: GiB as given, or P% of the device's memory less what is in use already (the weights:
    vLLM's `gpu_memory_utilization` reading). Refused when nothing is left."""
    kind, amount = spec
    if kind == "GiB":
        return int(amount * GiB)
    total, used = device_memory(device)
    budget = int(total * amount / 100) - used
    if budget <= 0:
        raise ValueError(f"{flag} {amount:g}%: {amount:g}% of {total / GiB:.1f} GiB leaves nothing for the "
                         f"cache beside the {used / GiB:.1f} GiB in use (weights); raise it or give GiB")
    return budget


def describe(target_bytes: int, drafter_bytes: int, budget_bytes: int | None, tokens: int, block_size: int,
             page_size: int, shares=FULL_ATTENTION) -> str:
    """One line: bytes per position, what a row of `tokens` (prompt + max_tokens) holds at its end, and how many
    such rows the budget holds (what `flashdraft serve` logs at start-up, for a row using the whole context);
    `shares`: `kv_shares`."""
    capacity = round(row_positions(tokens, block_size, page_size, shares))
    per_row = capacity * (target_bytes + drafter_bytes)
    windows = "" if shares == FULL_ATTENTION else " (sliding-window layers' positions at their share)"
    text = (f"KV cache: {target_bytes / 1024:.1f} KiB (target) + {drafter_bytes / 1024:.1f} KiB (drafter) per "
            f"position, in pages of {page_size}; a row of {tokens} tokens (prompt + max_tokens) holds up to "
            f"{capacity} positions{windows} = {per_row / GiB:.3f} GiB")
    if budget_bytes is not None:
        fit = rows_that_fit(budget_bytes, tokens, block_size, page_size, target_bytes, drafter_bytes, shares)
        positions = positions_for_budget(budget_bytes, target_bytes, drafter_bytes)
        text += f"; the budget of {budget_bytes / GiB:.3f} GiB holds {positions} positions = {fit} such rows"
    return text
