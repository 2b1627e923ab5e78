"""Bridge to transformers' built-in DFlash (`generate(assistant_model=..., speculation_type="dflash")`).

transformers ships the DFlash drafting loop (`DFlashTokenCandidateGenerator`) with one drafter architecture,
`MuseGlimmerAssistantModel`: the same pre-norm layers with context K/V injection, but with the fused projection
under `encoder.fc` / `encoder.output_norm_enc`. `to_transformers_assistant` builds that model from our drafter's
config and copies the weights, so the same checkpoint can be run by transformers' loop (batch 1, dynamic cache).
It is used to pin our attention math against an independent implementation and as a benchmark baseline.

What this module does not know about: the assistant attends bidirectionally in every layer (sliding layers get a
bidirectional window), so drafters with causal layers, and the other variants its config cannot state (attention
sinks, interleaved RoPE, own embedding / lm_head, reduced draft vocabulary, logit scaling), are refused, naming
the field (`unsupported_by_transformers_assistant`). Reading that class's checkpoints (`encoder.*` names, top-level
DFlash fields) is `DFlashDraftModel.from_pretrained`'s job (docs/checkpoints.md).
"""

from __future__ import annotations

import torch

from flashdraft.model.drafter import DFlashDraftModel

_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def transformers_dflash_available() -> bool:
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel  # noqa: F401
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
    except ImportError:
        return False
    return True


def unsupported_by_transformers_assistant(drafter: DFlashDraftModel) -> list[str]:
    """What transformers' `MuseGlimmerAssistantModel` cannot represent in `drafter` (empty: it maps exactly)."""
    attns = [layer.self_attn for layer in drafter.layers]
    reasons = []
    if getattr(drafter, "candidate_selector", None) is not None:
        reasons.append("DFlash2's convolutions and candidate selector (it reads DFlash-1 drafters only)")
    if any(a.is_causal for a in attns):
        reasons.append("causal layers (is_causal / dflash_config.causal / sliding layers without is_causal: false): "
                       "its attention is always bidirectional")
    if len({a.sliding_window for a in attns if a.sliding_window is not None}) > 1:
        reasons.append("sliding layers with different windows")
    if any(a.attention_sink_bias is not None for a in attns):
        reasons.append("attention sinks (dflash_config.attention_sink_bias)")
    if any(a.interleaved for a in attns):
        reasons.append("interleaved RoPE (is_neox_style: false)")
    for name, what in (("embed_tokens", "its own embed_tokens"), ("lm_head", "its own lm_head"),
                       ("d2t", "a reduced draft vocabulary (draft_vocab_size + d2t)"),
                       ("mask_embedding", "a separate mask embedding")):
        if getattr(drafter, name, None) is not None:
            reasons.append(what)
    if drafter.output_multiplier * drafter.logit_scale != 1.0 or drafter.final_logit_softcapping:
        reasons.append("logit scaling (logit_scale / output_multiplier / final_logit_softcapping)")
    if drafter.input_embedding_scale != 1.0:
        reasons.append("input_embedding_scale")
    return reasons


def to_transformers_assistant(drafter: DFlashDraftModel, dtype: torch.dtype | None = None):
    """A `MuseGlimmerAssistantModel` holding `drafter`'s weights (in `dtype`, default the drafter's), for
    transformers' own DFlash generation, which needs the assistant in the target's dtype. Refuses (ValueError,
    naming it) what that class cannot represent (`unsupported_by_transformers_assistant`)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    reasons = unsupported_by_transformers_assistant(drafter)
    if reasons:
        raise ValueError("transformers' DFlash assistant cannot represent this drafter: " + "; ".join(reasons))
    c = drafter.config
    windows = [layer.self_attn.sliding_window for layer in drafter.layers]
    config = MuseGlimmerAssistantConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=drafter.layers[0].self_attn.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        max_position_embeddings=c.max_position_embeddings,
        # its window is inclusive (|q - k| <= sliding_window), ours exclusive (q - k < window): one less there
        sliding_window=next((w - 1 for w in windows if w is not None), 4096),
        layer_types=["sliding_attention" if w is not None else "full_attention" for w in windows],
        hidden_act=c.hidden_act,
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        target_layer_ids=list(drafter.target_layer_ids),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    model = MuseGlimmerAssistantModel(config)
    state = {_RENAMES.get(k, k): v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping to transformers' assistant failed: missing {missing}, unexpected {unexpected}")
    return model.to(device=drafter.device, dtype=dtype or drafter.dtype).eval()


@torch.inference_mode()
def transformers_dflash_generate(target, drafter: DFlashDraftModel, input_ids: torch.Tensor, max_new_tokens: int,
                                 assistant=None, **generate_kwargs) -> torch.Tensor:
    """transformers' own DFlash loop (batch 1) driven by our drafter's weights; returns prompt + new tokens."""
    assistant = assistant if assistant is not None else to_transformers_assistant(drafter)
    return target.generate(
        input_ids,
        assistant_model=assistant,
        speculation_type="dflash",
        max_new_tokens=max_new_tokens,
        **generate_kwargs,
    )
