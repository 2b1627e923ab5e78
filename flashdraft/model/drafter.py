"""The DFlash drafter: a small block-diffusion model that proposes a whole block of tokens in one forward pass.

Design (docs/design.md, 'Drafter architecture'):
- The context feature is the concatenation of the target's hidden states at `target_layer_ids`, fused by one
  projection (`fc`, no bias) and an RMSNorm (`hidden_norm`). It is injected into the keys/values of every layer:
  keys/values are `[proj(context); proj(block)]`, queries come from the block only.
- Layers are pre-norm Qwen3 decoder layers (q/k per-head RMSNorm, RoPE at absolute positions, SiLU-gated MLP).
  Attention inside the block is bidirectional; `sliding_attention` layers see only the last `sliding_window`
  positions and, unless the config says otherwise (`is_causal` / `dflash_config.causal`), attend causally inside
  the block (vLLM's and the reference's reading, `layer_attention`). Checkpoint variants (attention sinks,
  interleaved RoPE, EAGLE-3 layer ids, a reduced draft vocabulary, ...) are resolved by `normalize_draft_config`
  (docs/checkpoints.md).
- The drafter owns no embedding and no lm_head: the block is embedded with the TARGET's embedding and read out
  through the TARGET's lm_head. Checkpoints therefore hold only the draft layers, `fc`, `hidden_norm`, `norm`.
- When decoding, context K/V lives in a paged per-row cache (`new_cache`, `slots.PagedKV`) that persists
  across cycles: `write_context` adds the newly committed positions, `draft` runs one block per row against it.
  Block K/V is never cached. Rejected context needs no rollback: it lies past the next block's start (masked)
  and is overwritten.

The checkpoint format is the reference one (config.json with `dflash_config` + model.safetensors, keys without a
`model.` prefix), so the same directory loads in the reference code, vLLM and SGLang. Weights load from
safetensors only.

What this module does not know about: the target model (see `target.py`), the decode loop (`flashdraft.engine`,
which also attaches the reference's one-call `spec_generate` to this class: `engine/compat.py`), and
training-time masks beyond accepting an explicit boolean mask (`flashdraft.train`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from flashdraft.model.slots import DEFAULT_PAGE_SIZE, DenseKV, PagedKV, new_paged_cache, window_starts

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DEFAULT_BLOCK_SIZE = 16
MASK_EMBEDDING_NAME = "mask_embedding.pt"
# the self-contained drafter code (torch + transformers 4.57 or 5.x) that `save_pretrained` writes beside the weights
# as `dflash.py`, for `AutoModel.from_pretrained(path, trust_remote_code=True)` (config `auto_map`)
REMOTE_CODE = Path(__file__).resolve().parent / "remote_code" / "dflash.py"
_STATE_RENAMES = (("encoder.output_norm_enc.", "hidden_norm."), ("encoder.fc.", "fc."), ("midlayer.", "layers.0."))


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


# ---- checkpoint variants (docs/checkpoints.md) ------------------------------------------------------------------
#
# Released DFlash drafters describe the same architecture with different fields. `normalize_draft_config` maps every
# variant we know onto one config (a Qwen3Config whose `dflash_config` holds the resolved DFlash fields) with the
# semantics vLLM's `qwen3_dflash.py` gives them, and refuses, naming the field, what we cannot honour. The helpers
# below read the normalized config; `layer_attention` and `resolve_target_layer_ids` follow vLLM's rules.

SLIDING = "sliding_attention"
MUSE_ASSISTANT = "muse_glimmer_assistant"
# transformers' own DFlash assistant class: its config class defaults (`MuseGlimmerAssistantConfig`), used for the
# fields such a config.json leaves out (it has no vocab_size at all: the vocabulary is the target's)
_MUSE_DEFAULTS = {
    "hidden_size": 6656, "intermediate_size": 19968, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "sliding_window": 2048, "hidden_act": "silu", "block_size": 16, "mask_token_id": 201818,
    "target_layer_ids": [1, 13, 25, 37, 49], "attention_dropout": 0.0,
}
_MUSE_DEFAULT_THETA = 500000.0
# DFlash2 checkpoints (grouped convolutions + a candidate selector, `dflash2.py`) look alike: each class loads only
# its own architecture, `flashdraft.loading.load_drafter` picks the class by name
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


def _eagle_layer_ids(raw: dict) -> tuple[list[int] | None, str | None]:
    """Aux layers in EAGLE-3 numbering (id L = the input of target layer L, i.e. the output of layer L-1), where the
    config gives them in that numbering; vLLM's `get_eagle3_aux_layers_from_config` order."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return list(ids), "eagle_aux_hidden_state_layer_ids"
    for name in ("dflash_config", "eagle_config"):
        nested = raw.get(name) or {}
        if isinstance(nested, dict):
            if nested.get("eagle_aux_hidden_state_layer_ids"):
                return list(nested["eagle_aux_hidden_state_layer_ids"]), f"{name}.eagle_aux_hidden_state_layer_ids"
            if nested.get("layer_ids") and not (raw.get("dflash_config") or {}).get("target_layer_ids") \
                    and not raw.get("target_layer_ids"):
                return list(nested["layer_ids"]), f"{name}.layer_ids"
    return None, None


def normalize_draft_config(raw: dict, source: str = "config.json", architecture: str = "DFlashDraftModel") -> dict:
    """The raw config.json of any known DFlash checkpoint variant, rewritten into our layout (a copy).

    Resolved into `dflash_config`: `mask_token_id`, `target_layer_ids` (DFlash numbering: tap the OUTPUT of these
    target layers), `block_size`. Kept as they are (read by the model): `layer_types`, `sliding_window`,
    `dflash_config.{use_swa, swa_window_size, causal, attention_sink_bias}`, `is_causal`, `is_neox_style`,
    `target_hidden_size`, `draft_vocab_size`, `logit_scale`. Raises CheckpointError naming a field it cannot honour.
    """
    cfg = json.loads(json.dumps(raw))  # deep copy
    nested = dict(cfg.get("dflash_config") or {})
    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise CheckpointError(f"{source}: eagle_config must be a JSON object")
    archs = cfg.get("architectures") or ["DFlashDraftModel"]
    if (DFLASH2_ARCHITECTURE in archs) != (architecture == DFLASH2_ARCHITECTURE):
        raise CheckpointError(f"{source}: architectures {archs} is not {architecture}; load it with "
                              f"{'DFlash2DraftModel' if DFLASH2_ARCHITECTURE in archs else 'DFlashDraftModel'} "
                              "(flashdraft.loading.load_drafter picks the class by architecture)")
    muse = cfg.get("model_type") == MUSE_ASSISTANT or "MuseGlimmerAssistantModel" in archs
    if muse:
        # transformers' own DFlash assistant: DFlash fields at top level, every layer bidirectional (its attention
        # has is_causal=False whatever the layer type), rope base default 5e5, class defaults for absent fields
        for key, value in _MUSE_DEFAULTS.items():
            cfg.setdefault(key, value)
        cfg.setdefault("layer_types", [SLIDING] * int(cfg["num_hidden_layers"]))
        if "rope_parameters" not in cfg and "rope_theta" not in cfg:
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": _MUSE_DEFAULT_THETA}
        cfg.setdefault("is_causal", False)
        cfg["model_type"] = "qwen3"
        cfg["architectures"] = ["DFlashDraftModel"]
        cfg["source_model_type"] = MUSE_ASSISTANT
        # its window is inclusive (transformers' bidirectional sliding mask: |q - k| <= sliding_window); ours, vLLM's and
        # z-lab's is exclusive (q - k < sliding_window), so the same attention is window + 1 here
        if cfg.get("sliding_window"):
            cfg["sliding_window"] = int(cfg["sliding_window"]) + 1
    elif cfg.get("model_type") not in (None, "qwen3"):
        # the layers are Qwen3 layers in every DFlash drafter; the model_type names the target family at most
        cfg["source_model_type"] = cfg["model_type"]
        cfg["model_type"] = "qwen3"
    if "vocab_size" not in cfg:  # the vocabulary is the target's; a config that does not state it is not checked
        cfg["vocab_size_declared"] = False

    use_aux = nested.get("use_aux_hidden_state", eagle.get("use_aux_hidden_state", cfg.get("use_aux_hidden_state")))
    if use_aux is False:
        raise CheckpointError(f"{source}: use_aux_hidden_state=false (the drafter reads the target's last hidden "
                              "state without fc) is not supported; DFlash drafters project tapped layers through fc")
    for key in ("mask_token_id", "block_size"):
        if nested.get(key) is None:
            for where in (cfg, eagle):
                if where.get(key) is not None:
                    nested[key] = where[key]
                    break

    # tapped layers: DFlash numbering (dflash_config.target_layer_ids / top-level target_layer_ids) or EAGLE-3
    # numbering (eagle_aux_hidden_state_layer_ids, eagle_config.layer_ids): DFlash id = EAGLE id - 1
    dflash_ids = nested.get("target_layer_ids") or cfg.get("target_layer_ids")
    eagle_ids, eagle_field = _eagle_layer_ids(cfg)
    if eagle_ids is not None:
        converted = [int(i) - 1 for i in eagle_ids]
        if min(converted) < 0:
            raise CheckpointError(f"{source}: {eagle_field} {eagle_ids} taps layer id 0 (the embedding output), "
                                  "which this loader cannot tap; DFlash taps decoder-layer outputs")
        if dflash_ids and [int(i) for i in dflash_ids] != converted:
            raise CheckpointError(
                f"{source}: {eagle_field} {eagle_ids} (EAGLE numbering, = DFlash target_layer_ids {converted}) "
                f"contradicts target_layer_ids {list(dflash_ids)}; vLLM would use {eagle_field}, z-lab's loader "
                "target_layer_ids: refusing the ambiguous checkpoint")
        dflash_ids = converted
    if dflash_ids:
        nested["target_layer_ids"] = [int(i) for i in dflash_ids]

    # sliding layers: per layer from layer_types, or every layer with dflash_config.use_swa (vLLM); the window is
    # dflash_config.swa_window_size or sliding_window. Qwen3Config drops sliding_window unless use_sliding_window
    # is set, so it is set whenever a layer slides (readers that build a Qwen3Config keep the window then too).
    n = int(cfg.get("num_hidden_layers", 1))
    layer_types = cfg.get("layer_types")
    if layer_types is not None and len(layer_types) != n:
        raise CheckpointError(f"{source}: layer_types has {len(layer_types)} entries for {n} layers")
    for lt in layer_types or []:
        if lt not in ("full_attention", SLIDING):
            raise CheckpointError(f"{source}: layer_types entry {lt!r} is not supported "
                                  "(full_attention or sliding_attention)")
    any_sliding = any(lt == SLIDING for lt in layer_types or [])
    if nested.get("use_swa"):
        any_sliding = True  # every layer slides; layer_types keep their say on causality (`layer_attention`)
    if layer_types is None:
        cfg["layer_types"] = ["full_attention"] * n  # not Qwen3Config's max_window_layers rule: vLLM's reading
    if any_sliding:
        window = nested.get("swa_window_size") or cfg.get("sliding_window")
        if not window:
            raise CheckpointError(f"{source}: sliding_attention layers need a window: dflash_config.swa_window_size "
                                  "or sliding_window")
        cfg["sliding_window"] = int(window)
        cfg["use_sliding_window"] = True

    if nested.get("causal") is not None and cfg.get("is_causal") is None:
        cfg["is_causal"] = bool(nested["causal"])
    if "attention_sink_bias" not in nested and cfg.get("add_swa_attention_sink_bias") is not None:
        nested["attention_sink_bias"] = bool(cfg["add_swa_attention_sink_bias"])

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict) and any(lt in rope for lt in ("full_attention", SLIDING)):
        raise CheckpointError(f"{source}: rope_parameters per layer type is not supported (one RoPE for all layers)")
    if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise CheckpointError(f"{source}: rope partial_rotary_factor {rope['partial_rotary_factor']} is not supported")

    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and cfg.get("vocab_size") is not None and int(draft_vocab) > int(cfg["vocab_size"]):
        raise CheckpointError(f"{source}: draft_vocab_size {draft_vocab} exceeds vocab_size {cfg['vocab_size']}")
    cfg["dflash_config"] = nested
    return cfg


def layer_attention(config, layer_idx: int) -> tuple[int | None, bool]:
    """(sliding_window, causal) of draft layer `layer_idx`, vLLM's rules: causal = top-level `is_causal` if set,
    else `dflash_config.causal` if set, else whether the layer slides; a sliding layer's window is
    `dflash_config.swa_window_size` or `sliding_window`."""
    nested = getattr(config, "dflash_config", None) or {}
    layer_types = getattr(config, "layer_types", None)
    typed_sliding = bool(layer_types) and layer_types[layer_idx] == SLIDING
    sliding = typed_sliding
    if nested.get("use_swa") and not any(lt == SLIDING for lt in layer_types or []):
        sliding = True  # use_swa: every layer slides (vLLM), but stays non-causal by default (typed full)
    window = None
    if sliding:
        window = nested.get("swa_window_size") or getattr(config, "sliding_window", None)
        if not window:
            raise CheckpointError(f"layer {layer_idx} is sliding_attention but the config gives no window "
                                  "(dflash_config.swa_window_size or sliding_window)")
        window = int(window)
    causal = getattr(config, "is_causal", None)
    if causal is None:
        causal = nested.get("causal")
    if causal is None:
        causal = typed_sliding
    return window, bool(causal)


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
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                         "rope_theta": getattr(tc, "rope_theta", 1e6)})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): one RoPE, the full layers'
        rope = dict(rope["full_attention"])
    # a multimodal target's text rope carries M-RoPE sections / a partial rotary factor for ITS layers; the drafter's
    # positions are 1-D and its heads fully rotary (as in z-lab's drafters for such targets)
    for key in ("mrope_section", "mrope_interleaved", "partial_rotary_factor"):
        rope.pop(key, None)
    if rope.get("rope_type") == "longrope" and len(rope.get("short_factor") or ()) != head_dim // 2:
        # LongRoPE's factors are per rotary frequency of the TARGET's heads (Phi-4-mini rotates 3/4 of them): for
        # the drafter's fully rotary heads, RoPE at the target's base
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
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


def fused_projection(owner: nn.Module, name: str, linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of `linears` side by side, for drafting: one GEMM instead of several (on CPU a 16-position
    bf16 projection costs ~40-70 us whatever its width: q/k/v as one 256 -> 512 projection save ~80 us per layer,
    gate/up ~40). Cached on `owner` under `name` (`derived_weights`)."""
    parts = [m.weight for m in linears] + [m.bias for m in linears if m.bias is not None]
    return derived_weights(owner, name, parts, lambda *_: concatenated(linears))


def derived_weights(owner: nn.Module, name: str, weights: list[torch.Tensor], build):
    """`build(*weights)` for drafting (without autograd), cached on `owner` under `name` and rebuilt when one of
    `weights` changes (training between evals); a graph being compiled builds it in the graph."""
    if torch.compiler.is_compiling():
        return build(*weights)
    # (inference tensors, as weights loaded under inference mode are, keep no version: nothing trains them)
    key = tuple((w.data_ptr(), -1 if w.is_inference() else w._version) for w in weights)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, build(*(w.detach() for w in weights)))
        owner.__dict__[name] = cached
    return cached[1]


def concatenated(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of `linears` side by side, concatenated now (autograd and compiled graphs see the cat)."""
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    return torch.cat([m.weight for m in linears]), bias


def records_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd records a projection of x by weight (training: the projections stay apart)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mlp(x)` for a SiLU-gated MLP (gate/up/down); without autograd its gate and up projections run as one."""
    if records_grad(x, mlp.gate_proj.weight):
        return mlp(x)
    weight, bias = fused_projection(mlp, "_fused_gate_up", [mlp.gate_proj, mlp.up_proj])
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """The GPT-J ("interleaved", vLLM `is_neox_style: false`) rotation: pairs (x0, x1), (x2, x3), ..."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [b, heads, n, d]; cos/sin [b, n, d] for the same n positions (transformers' layout: the d/2 frequencies
    twice). `interleaved`: rotate adjacent pairs (GPT-J) instead of the two halves (NeoX, the default)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if not interleaved:
        return x * cos + rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    return x * cos + rotate_every_two(x) * sin


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
        # vLLM's per-layer rules (`layer_attention`): sliding layers are causal inside the block unless the config
        # says otherwise (`is_causal` / `dflash_config.causal`)
        self.sliding_window, self.is_causal = layer_attention(config, layer_idx)
        self.interleaved = not bool(getattr(config, "is_neox_style", True))
        # per-head attention sinks (`dflash_config.attention_sink_bias`): one extra logit per head in the softmax
        # denominator that attends to nothing (gpt-oss style), as vLLM's `Attention(sinks=...)`
        sinks = bool(_dflash_value(config, "attention_sink_bias", False))
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None

    _compiled_flex = None  # torch.compile'd flex_attention, shared by all layers (CUDA only)

    def _flex(self, q, k, v, block_mask):
        from torch.nn.attention.flex_attention import flex_attention

        if self.attention_sink_bias is not None:
            raise NotImplementedError("attention sinks with a FlexAttention block mask (training) are not supported")
        fn = flex_attention
        if q.is_cuda:
            if DFlashAttention._compiled_flex is None:
                DFlashAttention._compiled_flex = torch.compile(flex_attention)
            fn = DFlashAttention._compiled_flex
        dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
        return fn(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=block_mask, scale=self.scaling,
                  enable_gqa=self.num_heads != self.num_kv_heads)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's q, k and v projections [b, n, width]; without autograd as one GEMM (`fused_projection`)."""
        if records_grad(x, self.q_proj.weight):
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        weight, bias = fused_projection(self, "_fused_qkv", [self.q_proj, self.k_proj, self.v_proj])
        kv_width = self.num_kv_heads * self.head_dim
        return F.linear(x, weight, bias).split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)

    def _sink_attention(self, q, k, v, mask):
        """Softmax over [scores, sink_h]; the sink's share goes nowhere."""
        if self.num_heads != self.num_kv_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        b, h, n, _ = scores.shape
        sink = self.attention_sink_bias.to(scores.dtype).view(1, h, 1, 1).expand(b, h, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs, v)

    def forward(self, x, ctx_kv, cos, sin, mask):
        """x: block hidden [b, q, H]; ctx_kv: this layer's context K/V, each [b, kv_heads, c, head_dim]."""
        b, q_len, _ = x.shape
        q, k_blk, v_blk = self._qkv(x)
        q = apply_rope(self.q_norm(q.view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2), cos, sin,
                       self.interleaved)
        k_blk = apply_rope(self.k_norm(k_blk.view(b, q_len, self.num_kv_heads, self.head_dim)).transpose(1, 2),
                           cos, sin, self.interleaved)
        v_blk = v_blk.view(b, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k_ctx, v_ctx = ctx_kv
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if self.attention_sink_bias is not None and (mask is None or isinstance(mask, torch.Tensor)):
            out = self._sink_attention(q, k, v, mask)
        elif mask is None or isinstance(mask, torch.Tensor):
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
        return x + gated_mlp(self.mlp, self.post_attention_layernorm(x))


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

    ARCHITECTURE = "DFlashDraftModel"  # config.json `architectures`; subclasses with other modules name their own

    def __init__(self, config: Qwen3Config, own_embedding: bool = False, own_lm_head: bool = False,
                 mask_embedding: bool = False):
        """`own_embedding` / `own_lm_head` / `mask_embedding`: the checkpoint ships `embed_tokens.weight` /
        `lm_head.weight` / a separate mask embedding (`from_pretrained` sets them from the weights it finds);
        otherwise the block is embedded and read out with the TARGET's embedding and lm_head."""
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
        self.logit_scale = float(getattr(config, "logit_scale", None) or 1.0)  # vLLM's LogitsProcessor scale
        self.final_logit_softcapping = _dflash_value(config, "final_logit_softcapping")
        H = config.hidden_size
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or H)
        if self.target_hidden_size != H and not (own_embedding and own_lm_head):
            raise CheckpointError(
                f"target_hidden_size {self.target_hidden_size} differs from the drafter's hidden_size {H}: the "
                "target's embedding and lm_head do not fit the drafter, and the checkpoint ships no "
                "embed_tokens.weight + lm_head.weight of its own")
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * self.target_hidden_size, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        vocab = int(config.vocab_size)
        draft_vocab = int(getattr(config, "draft_vocab_size", None) or vocab)
        self.embed_tokens = nn.Embedding(vocab, H) if own_embedding else None
        self.lm_head = nn.Linear(H, draft_vocab, bias=False) if own_lm_head else None
        if draft_vocab != vocab:
            # a reduced draft vocabulary (EAGLE-3 style): draft id d is target id d + d2t[d]
            if not own_lm_head:
                raise CheckpointError(f"draft_vocab_size {draft_vocab} != vocab_size {vocab} needs the drafter's "
                                      "own lm_head.weight, which the checkpoint does not ship")
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        else:
            self.d2t = None
        self.mask_embedding = nn.Parameter(torch.zeros(H)) if mask_embedding else None
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
        in one pass, as a dict {(sliding_window, is_causal): mask} when the layers differ (sliding-window
        drafters). Decoding keeps the context in a cache instead: `write_context` + `draft`.
        """
        ctx = self.project_context(target_hidden)
        if context_valid is None:
            context_valid = torch.ones(ctx.shape[:2], dtype=torch.bool, device=ctx.device)
        ctx_cos, ctx_sin = self.rotary_emb(ctx, context_position_ids)
        return self._blocks(noise_embedding, position_ids, self.context_kv(ctx, ctx_cos, ctx_sin),
                            context_position_ids, context_valid, attention_mask)

    def new_cache(self, batch: int, lengths: int | list[int] = 0, page_size: int = DEFAULT_PAGE_SIZE,
                  max_pages: int | None = None) -> PagedKV:
        """A paged context cache of `batch` rows with pages for `lengths` positions per row (one number: every
        row; a list: the first rows, the rest none)."""
        attn = self.layers[0].self_attn
        lengths = [lengths] * batch if isinstance(lengths, int) else lengths
        windows = [layer.self_attn.sliding_window for layer in self.layers]
        return new_paged_cache(windows, batch, attn.num_kv_heads, attn.head_dim, self.dtype, self.device, page_size,
                               lengths, max_pages)

    def write_context(self, cache: PagedKV, target_hidden: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Project target features [b, c, n_taps*H] at `positions` [b, c] into every layer's context K/V and store
        them at slot = position of cache rows `rows` [b] (default: rows 0 .. b-1). Slots where `valid` is False go
        to the cache's trash page, which no query attends to, so padded or rejected features never reach the
        context."""
        ctx = self.project_context(target_hidden)
        cos, sin = self.rotary_emb(ctx, positions)
        slots = cache.slots(positions, rows, valid)
        for i, (k, v) in enumerate(self.context_kv(ctx, cos, sin)):
            cache.write(i, slots, k.transpose(1, 2), v.transpose(1, 2))

    def draft(self, cache: PagedKV | DenseKV, noise_embedding: torch.Tensor, position_ids: torch.Tensor,
              context_len: int | None = None) -> torch.Tensor:
        """Hidden states [b, q, H] for one block per row at `position_ids` [b, q], attending to the cached context
        of each row: the slots before the row's block start (and inside the window of sliding layers).

        Only slots [0, context_len) are read (all of them when None: static shapes for compiled steps); a sliding
        layer's from the page holding the earliest slot its window shows any query (`_window_starts`)."""
        b = position_ids.shape[0]
        context_len = context_len or cache.capacity
        slot_positions = torch.arange(context_len, device=position_ids.device)[None].expand(b, -1)
        starts = self._window_starts(position_ids, cache)
        index = {w: cache.page_index(context_len, start=s, window=w) for w, s in starts.items()}
        ctx_kv = []
        for i, layer in enumerate(self.layers):
            window = layer.self_attn.sliding_window
            read = cache.read(i, context_len, index[window], starts[window])
            ctx_kv.append(tuple(t.transpose(1, 2) for t in read))
        return self._blocks(noise_embedding, position_ids, ctx_kv, slot_positions,
                            slot_positions < position_ids[:, :1], None, starts)

    def _window_starts(self, position_ids: torch.Tensor, cache) -> dict:
        """The first context slot each sliding window's layers read, for the block at `position_ids`
        (`slots.window_starts`, as the target's `FastTarget._window_starts`)."""
        return window_starts((layer.self_attn.sliding_window for layer in self.layers), position_ids, cache)

    def _blocks(self, noise_embedding, position_ids, ctx_kv, context_positions, context_valid, attention_mask,
                starts: dict | None = None):
        """The layers over the block's embeddings. Drafting (no `attention_mask`): each layer's context K/V starts at
        its window's slot in `starts` (`_window_starts`; None: slot 0), and so does its mask."""
        hidden = noise_embedding.to(self.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        masks: dict = {}
        for layer, layer_ctx_kv in zip(self.layers, ctx_kv):
            attn = layer.self_attn
            if isinstance(attention_mask, dict):  # training: one mask per (sliding window, causal) of the layers
                mask = attention_mask[(attn.sliding_window, attn.is_causal)]
            elif attention_mask is not None:
                mask = attention_mask
            else:
                key = (attn.sliding_window, attn.is_causal)
                if key not in masks:
                    start = starts[attn.sliding_window] if starts else 0
                    masks[key] = block_attention_mask(position_ids, context_positions[:, start:],
                                                      context_valid[:, start:], *key)
                mask = masks[key]
            hidden = layer(hidden, layer_ctx_kv, cos, sin, mask)
        return self.norm(hidden)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context K/V ([b, kv_heads, c, head_dim], k-normed and rotated) from ONE matmul over the
        stacked k/v projections of all layers, instead of two small matmuls per layer."""
        attns = [layer.self_attn for layer in self.layers]
        projections = [p for a in attns for p in (a.k_proj, a.v_proj)]
        if records_grad(ctx, projections[0].weight):
            weight, bias = concatenated(projections)
        else:
            weight, bias = fused_projection(self, "_fused_context_kv", projections)
        b, c, _ = ctx.shape
        width = 2 * attns[0].num_kv_heads * attns[0].head_dim  # every layer has the same K/V width
        out = []
        for a, kv in zip(attns, F.linear(ctx, weight, bias).split(width, dim=-1)):
            k, v = kv.view(b, c, 2, a.num_kv_heads, a.head_dim).unbind(2)
            out.append((apply_rope(a.k_norm(k).transpose(1, 2), cos, sin, a.interleaved), v.transpose(1, 2)))
        return out

    def readout(self, lm_head: nn.Module) -> nn.Module:
        """The projection drafts are read out through: the drafter's own lm_head where the checkpoint ships one
        (over the draft vocabulary), else `lm_head` (the TARGET's)."""
        return self.lm_head if self.lm_head is not None else lm_head

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Read the draft hidden states out through the TARGET's lm_head (the drafter's own, where the checkpoint
        ships one), times `logit_scale` (vLLM) and `output_multiplier` (reference), softcapped where configured.
        A reduced draft vocabulary (`draft_vocab_size` + `d2t`) is scattered onto the target's vocabulary, every
        other id at -inf, as vLLM does."""
        logits = self.draft_logits(hidden, self.readout(lm_head))
        if self.d2t is not None:
            full = logits.new_full((*logits.shape[:-1], int(self.config.vocab_size)), float("-inf"))
            targets = torch.arange(self.d2t.shape[0], device=logits.device) + self.d2t
            full[..., targets] = logits
            logits = full
        return logits

    def draft_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Logits over the draft vocabulary (draft id d = target id d + d2t[d] with a reduced one), through `head`
        as given (`readout`, or a packed copy of it), scaled and softcapped as `compute_logits`; not scattered."""
        logits = head(hidden.to(head.weight.dtype))
        scale = self.output_multiplier * self.logit_scale
        if scale != 1.0:
            logits = logits * scale
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, input_ids: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        """Embed block tokens with the target's raw embedding table (no model-specific embedding scaling), or the
        drafter's own `embed_tokens` where it ships one; a separate `mask_embedding` replaces the mask slots."""
        if self.embed_tokens is not None:
            embedding_weight = self.embed_tokens.weight
        emb = F.embedding(input_ids, embedding_weight)
        if self.input_embedding_scale != 1.0:
            emb = emb * self.input_embedding_scale
        if self.mask_embedding is not None:
            emb = torch.where((input_ids == self.mask_token_id)[..., None], self.mask_embedding.to(emb.dtype), emb)
        return emb

    # ---- checkpoint format ----------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write config.json + model.safetensors in the reference layout (no `model.` prefix, no embedding/lm_head
        unless the drafter has its own), the config in both transformers 4.x and 5.x spellings (`export_config`),
        `dflash.py` for `AutoModel.from_pretrained(path, trust_remote_code=True)`, and `mask_embedding.pt` where
        the drafter has a separate mask embedding (the file vLLM reads)."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        dtype = dtype or self.dtype
        state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
                 for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        save_file(self.checkpoint_names(state), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        if self.mask_embedding is not None:
            torch.save({"mask_token_id": self.mask_token_id, "embedding": state["mask_embedding"].clone()},
                       out / MASK_EMBEDDING_NAME)
        config = self.export_config(dtype)
        with open(out / CONFIG_NAME, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if "auto_map" in config:  # the remote code runs DFlash-1 only
            shutil.copyfile(REMOTE_CODE, out / REMOTE_CODE.name)
        return out

    def checkpoint_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state dict under the names the checkpoint format stores (the same names here; see dflash2.py)."""
        return state

    def export_config(self, dtype: torch.dtype | None = None) -> dict:
        """config.json as every reader needs it (docs/checkpoints.md): the rope base as transformers 5.x reads it
        (`rope_parameters`) AND as 4.x reads it (`rope_theta` + `rope_scaling`), `dtype` and `torch_dtype`, the
        DFlash fields nested and at top level, `use_sliding_window` whenever a layer slides (Qwen3Config drops the
        window otherwise), the resolved causality as top-level `is_causal` where it is not the layer-type default,
        and `auto_map` pointing at the `dflash.py` that `save_pretrained` writes beside the weights."""
        cfg = self.config.to_dict()
        for key in ("vocab_size_declared", "source_model_type", "_name_or_path"):
            cfg.pop(key, None)
        if getattr(self.config, "vocab_size_declared", True) is False:
            cfg.pop("vocab_size", None)
        cfg["architectures"] = [self.ARCHITECTURE]
        cfg["model_type"] = "qwen3"
        rope = dict(getattr(self.config, "rope_parameters", None) or {})
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", float(getattr(self.config, "rope_theta", None) or 10000.0))
        cfg["rope_parameters"] = rope
        cfg["rope_theta"] = float(rope["rope_theta"])
        cfg["rope_scaling"] = (None if rope["rope_type"] == "default"
                               else {k: v for k, v in rope.items() if k != "rope_theta"})
        name = str(dtype or self.dtype).replace("torch.", "")
        cfg["dtype"] = cfg["torch_dtype"] = name
        nested = dict(cfg.get("dflash_config") or {})
        nested.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids),
                      block_size=self.block_size)
        # optional tensors this checkpoint ships, for readers that build the model from the config alone (our
        # dflash.py); vLLM and our loader detect them from the weights
        extra = [name for name in ("embed_tokens", "lm_head", "mask_embedding") if getattr(self, name) is not None]
        if extra:
            nested["extra_weights"] = extra
        else:
            nested.pop("extra_weights", None)
        cfg["dflash_config"] = nested
        cfg["block_size"] = self.block_size
        for key in ("mask_token_id", "target_layer_ids"):
            cfg.pop(key, None)  # one place for them (nested), so no reader sees two values
        windows = [layer.self_attn.sliding_window for layer in self.layers]
        if any(w is not None for w in windows):
            cfg["use_sliding_window"] = True
            cfg["sliding_window"] = next(w for w in windows if w is not None)
            cfg["layer_types"] = [SLIDING if w is not None else "full_attention" for w in windows]
            nested.pop("use_swa", None)  # spelled out per layer in layer_types
        causal = [layer.self_attn.is_causal for layer in self.layers]
        if causal != [w is not None for w in windows]:  # not the readers' default (sliding <=> causal)
            if len(set(causal)) != 1:
                raise ValueError(f"per-layer causality {causal} cannot be written as one is_causal flag")
            cfg["is_causal"] = causal[0]
        cfg["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
        return cfg

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | os.PathLike,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        revision: str | None = None,
    ) -> "DFlashDraftModel":
        """Load a drafter from a local directory or a Hugging Face hub id: the reference layout and the variants
        of docs/checkpoints.md (vLLM's reading of them), or a CheckpointError naming what cannot be honoured."""
        # the config is read and checked before any weight is (a target directory passed by mistake is refused
        # without reading gigabytes; from the hub, only the JSON files are fetched until the config passes)
        directory = _resolve_checkpoint_dir(path_or_hub_id, revision, weights=False)
        config_path = directory / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(f"{directory}: no {CONFIG_NAME}; not a DFlash drafter checkpoint")
        raw = check_draft_config_file(config_path)
        config = draft_config_from_dict(raw, source=str(config_path), architecture=cls.ARCHITECTURE)
        if not Path(path_or_hub_id).exists():
            directory = _resolve_checkpoint_dir(path_or_hub_id, revision, weights=True)
        state = normalize_state_names(_load_safetensors(directory), source=str(directory))
        mask = _load_mask_embedding(directory, int(_dflash_value(config, "mask_token_id")))
        if mask is not None:
            if "mask_embedding" in state and not torch.equal(state["mask_embedding"].reshape(-1).float(), mask.float()):
                raise CheckpointError(f"{directory}: {MASK_EMBEDDING_NAME} and the mask_embedding weight differ")
            state["mask_embedding"] = mask
        if "mask_embedding" in state:
            state["mask_embedding"] = state["mask_embedding"].reshape(-1)
        try:
            model = cls(config, own_embedding="embed_tokens.weight" in state, own_lm_head="lm_head.weight" in state,
                        mask_embedding="mask_embedding" in state)
        except CheckpointError as exc:
            raise CheckpointError(f"{config_path}: {exc}") from exc
        if any(t.dtype == torch.float64 for t in state.values()):
            model.double()  # a float64 checkpoint loads exactly, not through float32 parameters
        model.load_checkpoint_state(state, source=str(directory))
        model.to(device=device, dtype=dtype or _checkpoint_dtype(state))
        return model.eval()

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        state = normalize_state_names(state, source)
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
        if self.d2t is not None and "d2t" in state:
            ids = torch.arange(state["d2t"].shape[0]) + state["d2t"].long().cpu()
            if ids.min() < 0 or ids.max() >= int(self.config.vocab_size):
                raise CheckpointError(f"{source}: d2t maps draft ids outside the target vocabulary "
                                      f"[0, {self.config.vocab_size})")
        self.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def check_draft_config_file(config_path: Path) -> dict:
    """The raw drafter config, refused (CheckpointError) unless it is JSON carrying the DFlash fields
    (`dflash_config` with target_layer_ids and mask_token_id, the older top-level fields, EAGLE-3 style aux layer
    ids, or transformers' own DFlash assistant config)."""
    try:
        raw = json.loads(Path(config_path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: cannot parse drafter config: {str(exc).splitlines()[0]}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: a drafter config is a JSON object")
    nested = raw.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise CheckpointError(f"{config_path}: dflash_config must be a JSON object")
    if raw.get("model_type") == MUSE_ASSISTANT:
        return raw
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    have = {
        "target_layer_ids": nested.get("target_layer_ids") or raw.get("target_layer_ids")
        or _eagle_layer_ids(raw)[0],
        "mask_token_id": next((d["mask_token_id"] for d in (nested, raw, eagle) if d.get("mask_token_id") is not None),
                              None),
    }
    missing = [k for k, v in have.items() if v is None]
    if missing:
        what = "no dflash_config" if not nested else f"dflash_config lacks {', '.join(missing)}"
        raise CheckpointError(f"{config_path}: {what}; not a DFlash drafter checkpoint (a target model directory?)")
    return raw


def draft_config_from_dict(raw: dict, source: str = "config.json", architecture: str = "DFlashDraftModel") -> Qwen3Config:
    """A Qwen3Config for the drafter from a raw config.json of any known variant (`normalize_draft_config`)."""
    cfg = normalize_draft_config(raw, source, architecture)
    try:
        return Qwen3Config.from_dict(cfg)
    except Exception as exc:  # malformed fields
        raise CheckpointError(f"{source}: cannot parse drafter config: {str(exc).splitlines()[0]}") from exc


def normalize_state_names(state: dict[str, torch.Tensor], source: str = "state dict") -> dict[str, torch.Tensor]:
    """Weight names of every known layout mapped onto ours: a `model.` prefix is stripped, transformers' assistant
    names `encoder.fc` / `encoder.output_norm_enc` become `fc` / `hidden_norm`, an EAGLE-style `midlayer.` is layer
    0, `t2d` (target-to-draft ids, unused when drafting) is dropped as vLLM drops it; `mask_hidden` is refused."""
    out = {}
    for name, tensor in state.items():
        if "mask_hidden" in name:
            raise CheckpointError(f"{source}: weight {name}: a mask_hidden tensor is not part of DFlash (masked slots "
                                  f"are embedded from mask_token_id, or from a separate {MASK_EMBEDDING_NAME})")
        name = name.removeprefix("model.")
        if name == "t2d":
            continue
        for old, new in _STATE_RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = tensor
    return out


def _load_mask_embedding(directory: Path, mask_token_id: int) -> torch.Tensor | None:
    """`mask_embedding.pt` beside the weights (vLLM's format: a tensor, or {"mask_token_id", "embedding"}), read with
    torch's weights-only unpickler; None when there is none."""
    path = Path(directory) / MASK_EMBEDDING_NAME
    if not path.is_file():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read the mask embedding: {str(exc).splitlines()[0]}") from exc
    if isinstance(data, dict):
        if data.get("mask_token_id", mask_token_id) != mask_token_id:
            raise CheckpointError(f"{path}: mask_token_id {data.get('mask_token_id')} does not match "
                                  f"dflash_config.mask_token_id {mask_token_id}")
        data = data.get("embedding")
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"{path}: expected a tensor or {{'embedding': tensor}}")
    return data.reshape(-1)


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
        patterns = ["*.json", "*.md"] + (["*.safetensors", MASK_EMBEDDING_NAME] if weights else [])
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

