"""Bridge to transformers' built-in DFlash (`generate(assistant_model=..., speculation_type="dflash")`).

transformers ships the DFlash drafting loop (`DFlashTokenCandidateGenerator`) with one drafter architecture,
`MuseGlimmerAssistantModel`: the same pre-norm layers with context K/V injection, but with the fused projection
under `encoder.fc` / `encoder.output_norm_enc`. `to_transformers_assistant` builds that model from our drafter's
config and copies the weights, so the same checkpoint can be run by transformers' loop (batch 1, dynamic cache).
It is used to pin our attention math against an independent implementation and as a benchmark baseline.

What this module does not know about: sliding-window drafters are mapped, but transformers' assistant applies its
window to every layer type it is given; `is_causal` drafters are not representable and are refused.
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


def to_transformers_assistant(drafter: DFlashDraftModel, dtype: torch.dtype | None = None):
    """A `MuseGlimmerAssistantModel` holding `drafter`'s weights (in `dtype`, default the drafter's), for
    transformers' own DFlash generation, which needs the assistant in the target's dtype."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    if getattr(drafter.config, "is_causal", False):
        raise ValueError("transformers' DFlash assistant has no causal-block variant; this drafter cannot be exported")
    c = drafter.config
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
        sliding_window=c.sliding_window or 4096,
        layer_types=list(c.layer_types),
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
