"""The DFlash drafter: a small block-diffusion model that proposes a whole block of tokens in one forward pass.

Design (docs/design.md, 'Drafter architecture'):
- The context feature is the concatenation of the target's hidden states at `target_layer_ids`, fused by one
  projection (`fc`, no bias) and an RMSNorm (`hidden_norm`). It is injected into the keys/values of every layer:
  keys/values are `[proj(context); proj(block)]`, queries come from the block only.
- Layers are pre-norm Qwen3 decoder layers (q/k per-head RMSNorm, RoPE at absolute positions, SiLU-gated MLP).
  Attention inside the block is bidirectional; `sliding_attention` layers see only the last `sliding_window`
  positions of the context. A config field `is_causal: true` (newer reference drafters) makes the block causal.
- The drafter owns no embedding and no lm_head: the block is embedded with the TARGET's embedding and read out
  through the TARGET's lm_head. Checkpoints therefore hold only the draft layers, `fc`, `hidden_norm`, `norm`.
- When decoding, context K/V lives in a static per-row cache (`new_cache`, slot = position) that persists
  across cycles: `write_context` adds the newly committed positions, `draft` runs one block per row against it.
  Block K/V is never cached. Rejected context needs no rollback: it lies past the next block's start (masked)
  and is overwritten.

The checkpoint format is the reference one (config.json with `dflash_config` + model.safetensors, keys without a
`model.` prefix), so the same directory loads in the reference code, vLLM and SGLang. Weights load from
safetensors only.

What this module does not know about: the target model (see `target.py`), the decode loop (`flashdraft.engine`),
and training-time masks beyond accepting an explicit boolean mask (`flashdraft.train`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from flashdraft.model.slots import StaticKV

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DEFAULT_BLOCK_SIZE = 16


class CheckpointError(ValueError):
    """A drafter checkpoint is missing, corrupt, or does not match the model it is loaded into."""


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The reference's default taps: `num_taps` ids evenly spaced from 1 to L-3; a single tap is L // 2."""
    if num_taps < 1 or num_target_layers < 1:
        raise ValueError(f"need num_target_layers >= 1 and num_taps >= 1, got {num_target_layers}, {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"a target with {num_target_layers} layers is too shallow for {num_taps} taps")
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


def _dflash_value(config, name: str, default=None):
    """Newer checkpoints keep DFlash fields in `dflash_config`, older ones at top level: read both."""
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested and nested[name] is not None:
        return nested[name]
    value = getattr(config, name, None)
    return default if value is None else value


def make_draft_config(
    target_config,
    num_layers: int = 5,
    block_size: int = DEFAULT_BLOCK_SIZE,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    num_taps: int | None = None,
    intermediate_size: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
) -> Qwen3Config:
    """A drafter config for `target_config` in the reference layout (hidden size = the target's)."""
    tc = getattr(target_config, "text_config", None) or target_config
    num_target_layers = tc.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_taps or num_layers)
    if mask_token_id is None:
        raise ValueError("mask_token_id is required: pick a token id of the target's vocabulary reserved for masking")
    heads = tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    layer_types = layer_types or ["full_attention"] * num_layers
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 1e6)}
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=dict(rope),
        layer_types=layer_types,
        sliding_window=sliding_window,
        use_sliding_window=sliding_window is not None,
        max_window_layers=num_layers,
        tie_word_embeddings=False,
        attention_bias=False,
        architectures=["DFlashDraftModel"],
        num_target_layers=num_target_layers,
        block_size=block_size,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids),
                       "block_size": int(block_size)},
    )
    config.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    return config


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d]; cos/sin [b, n, d] for the same n positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        layer_type = layer_types[layer_idx] if layer_types else "full_attention"
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        self.is_causal = bool(getattr(config, "is_causal", False) or False)

    _compiled_flex = None  # torch.compile'd flex_attention, shared by all layers (CUDA only)

    def _flex(self, q, k, v, block_mask):
        from torch.nn.attention.flex_attention import flex_attention

        fn = flex_attention
        if q.is_cuda:
            if DFlashAttention._compiled_flex is None:
                DFlashAttention._compiled_flex = torch.compile(flex_attention)
            fn = DFlashAttention._compiled_flex
        dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
        return fn(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=block_mask, scale=self.scaling,
                  enable_gqa=self.num_heads != self.num_kv_heads)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx_kv, cos, sin, mask):
        """x: block hidden [b, q, H]; ctx_kv: this layer's context K/V, each [b, kv_heads, c, head_dim]."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_ctx, v_ctx = ctx_kv
        k_blk, v_blk = self._kv(x, cos, sin)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if mask is None or isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=self.num_heads != self.num_kv_heads
            )
        else:  # a FlexAttention BlockMask (training: many blocks of a sequence in one pass, sparse mask)
            out = self._flex(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx_kv, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_attention_mask(
    query_positions: torch.Tensor,
    context_positions: torch.Tensor,
    context_valid: torch.Tensor,
    sliding_window: int | None,
    is_causal: bool,
) -> torch.Tensor:
    """Boolean mask [b, 1, q, c + q] for one block per row: all valid context (inside the window), then the block.

    Context slots are strictly before the block in position, so only validity and the window restrict them.
    """
    qp = query_positions[:, :, None]
    ctx_ok = context_valid[:, None, :].expand(-1, qp.shape[1], -1)
    blk_ok = torch.ones(qp.shape[0], qp.shape[1], qp.shape[1], dtype=torch.bool, device=qp.device)
    if sliding_window is not None:
        ctx_ok = ctx_ok & (qp - context_positions[:, None, :] < sliding_window)
        blk_ok = blk_ok & ((qp - query_positions[:, None, :]).abs() < sliding_window)
    if is_causal:
        blk_ok = blk_ok & (query_positions[:, None, :] <= qp)
    return torch.cat([ctx_ok, blk_ok], dim=2)[:, None]


class DFlashDraftModel(nn.Module):
    """The DFlash drafter. See the module docstring for the design."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.target_layer_ids = _dflash_value(config, "target_layer_ids")
        if not self.target_layer_ids:
            raise CheckpointError("drafter config must define dflash_config.target_layer_ids")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.mask_token_id = _dflash_value(config, "mask_token_id")
        if self.mask_token_id is None:
            raise CheckpointError("drafter config must define dflash_config.mask_token_id")
        self.mask_token_id = int(self.mask_token_id)
        self.block_size = int(_dflash_value(config, "block_size", DEFAULT_BLOCK_SIZE))
        self.input_embedding_scale = float(_dflash_value(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(_dflash_value(config, "output_multiplier", 1.0))
        self.final_logit_softcapping = _dflash_value(config, "final_logit_softcapping")
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        std = std if std is not None else getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the concatenated target hidden states [b, c, n_taps * H] into one context feature [b, c, H]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def forward(
        self,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        context_position_ids: torch.Tensor,
        context_valid: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [b, q, H] (after the final norm) for the block(s) in `noise_embedding`, given the whole
        context: target_hidden [b, c, n_taps*H] at `context_position_ids` [b, c].

        `context_valid` [b, c] marks real slots (padding otherwise). `attention_mask` [b, 1, q, c + q] (bool, True
        = attend) overrides the default one-block-per-row mask; training uses it to put many blocks of a sequence
        in one pass. Decoding keeps the context in a cache instead: `write_context` + `draft`.
        """
        ctx = self.project_context(target_hidden)
        if context_valid is None:
            context_valid = torch.ones(ctx.shape[:2], dtype=torch.bool, device=ctx.device)
        ctx_cos, ctx_sin = self.rotary_emb(ctx, context_position_ids)
        return self._blocks(noise_embedding, position_ids, self.context_kv(ctx, ctx_cos, ctx_sin),
                            context_position_ids, context_valid, attention_mask)

    def new_cache(self, batch: int, capacity: int) -> StaticKV:
        """A static context cache for `capacity` positions per row (plus one scratch slot for padding)."""
        attn = self.layers[0].self_attn
        return StaticKV(len(self.layers), batch, capacity + 1, attn.num_kv_heads, attn.head_dim, self.dtype,
                        self.device)

    def write_context(self, cache: StaticKV, target_hidden: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor) -> None:
        """Project target features [b, c, n_taps*H] at `positions` [b, c] into every layer's context K/V and store
        them at slot = position. Slots where `valid` is False go to the scratch slot (the last one), which no
        query attends to, so padded or rejected features never reach the context."""
        ctx = self.project_context(target_hidden)
        cos, sin = self.rotary_emb(ctx, positions)
        slots = torch.where(valid, positions, cache.capacity - 1)
        for i, (k, v) in enumerate(self.context_kv(ctx, cos, sin)):
            cache.write(i, slots, k.transpose(1, 2), v.transpose(1, 2))

    def draft(self, cache: StaticKV, noise_embedding: torch.Tensor, position_ids: torch.Tensor,
              context_len: int | None = None) -> torch.Tensor:
        """Hidden states [b, q, H] for one block per row at `position_ids` [b, q], attending to the cached context
        of each row: the slots before the row's block start (and inside the window of sliding layers).

        Only slots [0, context_len) are read (all of them when None: static shapes for compiled steps)."""
        b = position_ids.shape[0]
        context_len = context_len or cache.capacity
        slot_positions = torch.arange(context_len, device=position_ids.device)[None].expand(b, -1)
        ctx_kv = [(k[:, :context_len].transpose(1, 2), v[:, :context_len].transpose(1, 2))
                  for k, v in zip(cache.keys, cache.values)]
        return self._blocks(noise_embedding, position_ids, ctx_kv, slot_positions,
                            slot_positions < position_ids[:, :1], None)

    def _blocks(self, noise_embedding, position_ids, ctx_kv, context_positions, context_valid, attention_mask):
        hidden = noise_embedding.to(self.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        masks: dict = {}
        for layer, layer_ctx_kv in zip(self.layers, ctx_kv):
            attn = layer.self_attn
            if attention_mask is not None:
                mask = attention_mask
            else:
                key = (attn.sliding_window, attn.is_causal)
                if key not in masks:
                    masks[key] = block_attention_mask(position_ids, context_positions, context_valid, *key)
                mask = masks[key]
            hidden = layer(hidden, layer_ctx_kv, cos, sin, mask)
        return self.norm(hidden)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context K/V ([b, kv_heads, c, head_dim], k-normed and rotated) from ONE matmul over the
        stacked k/v projections of all layers, instead of two small matmuls per layer."""
        attns = [layer.self_attn for layer in self.layers]
        weight = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])
        bias = None
        if attns[0].k_proj.bias is not None:
            bias = torch.cat([bb for a in attns for bb in (a.k_proj.bias, a.v_proj.bias)])
        b, c, _ = ctx.shape
        width = 2 * attns[0].num_kv_heads * attns[0].head_dim  # every layer has the same K/V width
        out = []
        for a, kv in zip(attns, F.linear(ctx, weight, bias).split(width, dim=-1)):
            k, v = kv.view(b, c, 2, a.num_kv_heads, a.head_dim).unbind(2)
            out.append((apply_rope(a.k_norm(k).transpose(1, 2), cos, sin), v.transpose(1, 2)))
        return out

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Read the draft hidden states out through the TARGET's lm_head (plus the reference's optional scalings)."""
        logits = lm_head(hidden.to(lm_head.weight.dtype))
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, input_ids: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        """Embed block tokens with the target's raw embedding table (no model-specific embedding scaling)."""
        emb = F.embedding(input_ids, embedding_weight)
        return emb * self.input_embedding_scale if self.input_embedding_scale != 1.0 else emb

    # ---- checkpoint format ----------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write config.json + model.safetensors in the reference layout (no `model.` prefix, no embedding/lm_head)."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()
                 if not k.startswith("rotary_emb.")}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        config = self.config.to_dict()
        config["architectures"] = ["DFlashDraftModel"]
        config["dtype"] = str(dtype or self.dtype).replace("torch.", "")
        with open(out / CONFIG_NAME, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        return out

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | os.PathLike,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        revision: str | None = None,
    ) -> "DFlashDraftModel":
        """Load a drafter from a local directory or a Hugging Face hub id (reference / vLLM / SGLang layout)."""
        # the config is read and checked before any weight is (a target directory passed by mistake is refused
        # without reading gigabytes; from the hub, only the JSON files are fetched until the config passes)
        directory = _resolve_checkpoint_dir(path_or_hub_id, revision, weights=False)
        config_path = directory / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(f"{directory}: no {CONFIG_NAME}; not a DFlash drafter checkpoint")
        check_draft_config_file(config_path)
        try:
            config = Qwen3Config.from_pretrained(str(directory))
        except Exception as exc:  # malformed fields
            raise CheckpointError(f"{config_path}: cannot parse drafter config: {str(exc).splitlines()[0]}") from exc
        model = cls(config)
        if not Path(path_or_hub_id).exists():
            directory = _resolve_checkpoint_dir(path_or_hub_id, revision, weights=True)
        state = _load_safetensors(directory)
        model.load_checkpoint_state(state, source=str(directory))
        model.to(device=device, dtype=dtype or _checkpoint_dtype(state))
        return model.eval()

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        state = {k.removeprefix("model."): v for k, v in state.items()}
        expected = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(k for k in set(state) - set(expected) if not k.startswith("rotary_emb."))
        if missing or unexpected:
            raise CheckpointError(
                f"{source}: weights do not match the config; missing {missing[:8]}{'...' if len(missing) > 8 else ''}"
                f", unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )
        for name, tensor in state.items():
            if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
                raise CheckpointError(
                    f"{source}: weight {name} has shape {tuple(tensor.shape)}, config expects {tuple(expected[name].shape)}"
                )
            if name in expected and not torch.isfinite(tensor.float()).all():
                raise CheckpointError(f"{source}: weight {name} contains NaN or inf")
        self.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- reference-compatible entry point -------------------------------------------------------------------

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> torch.LongTensor:
        """Drop-in for the reference: returns `[1, prompt + generated]` token ids (generation ends after a stop id)."""
        from flashdraft.engine import SamplingParams, SpecEngine

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                stop_token_ids=tuple(stop_token_ids or ()))
        rows = [ids for ids in input_ids.tolist()]
        with SpecEngine(target, self) as engine:  # one engine per call: its hooks come off the target after it
            results = engine.generate(rows, params)
        if len(results) == 1:
            return torch.tensor([rows[0] + results[0].token_ids], dtype=torch.long, device=input_ids.device)
        return [torch.tensor([r + res.token_ids], device=input_ids.device) for r, res in zip(rows, results)]


def check_draft_config_file(config_path: Path) -> dict:
    """The raw drafter config, refused (CheckpointError) unless it is JSON carrying the DFlash fields
    (`dflash_config` with target_layer_ids and mask_token_id, or the older top-level fields)."""
    try:
        raw = json.loads(Path(config_path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: cannot parse drafter config: {str(exc).splitlines()[0]}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: a drafter config is a JSON object")
    nested = raw.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise CheckpointError(f"{config_path}: dflash_config must be a JSON object")
    missing = [k for k in ("target_layer_ids", "mask_token_id") if nested.get(k) is None and raw.get(k) is None]
    if missing:
        what = "no dflash_config" if not nested else f"dflash_config lacks {', '.join(missing)}"
        raise CheckpointError(f"{config_path}: {what}; not a DFlash drafter checkpoint (a target model directory?)")
    return raw


def _resolve_checkpoint_dir(path_or_hub_id, revision=None, weights: bool = True) -> Path:
    path = Path(path_or_hub_id)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; a drafter checkpoint is a directory with {CONFIG_NAME}")
        return path
    if str(path_or_hub_id).count("/") != 1 or str(path_or_hub_id).startswith((".", "/")):
        raise CheckpointError(f"{path_or_hub_id}: no such directory (and not a hub id of the form org/name)")
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.md"] + (["*.safetensors"] if weights else [])
        return Path(snapshot_download(str(path_or_hub_id), revision=revision, allow_patterns=patterns))
    except Exception as exc:
        raise CheckpointError(f"{path_or_hub_id}: not a local directory and the hub download failed: "
                              f"{type(exc).__name__}: {(str(exc).strip() or '?').splitlines()[0]}") from exc


def _load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" (found {bins}: pickle weights are not loaded; convert them to safetensors)" if bins else ""
        raise CheckpointError(f"{directory}: no *.safetensors weights{hint}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as exc:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file: "
                                  f"{(str(exc).strip() or type(exc).__name__).splitlines()[0]}") from exc
    return state


def _checkpoint_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """Keep the stored floating dtype, except that half precision is upcast on CPU-only machines."""
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    if dtype in (torch.float16, torch.bfloat16) and not torch.cuda.is_available():
        return torch.float32
    return dtype

