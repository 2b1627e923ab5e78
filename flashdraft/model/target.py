"""The target side: any decoder-only `AutoModelForCausalLM`, seen through the few things DFlash needs from it.

`TargetModel` wraps a transformers causal LM and gives the engine one call, `forward(...) -> (logits, features)`,
where `features` is the concatenation of the outputs of the decoder layers in `target_layer_ids` (transformers
numbering `hidden_states[id + 1]`). Only those layers are captured, with forward hooks on the decoder layers, so
no model has to materialise all its hidden states. The embedding table and lm_head are borrowed by the drafter.

`validate_pair` refuses a drafter that does not fit the target, naming the field and both values.

What this module does not know about: batching policy and KV-cache bookkeeping (the engine passes the cache,
attention mask and positions through), and models whose decoder layers it cannot find (it says so).
"""

from __future__ import annotations

import torch
from torch import nn


class PairMismatchError(ValueError):
    """The drafter was trained for a different target (or is misconfigured for this one)."""


def text_config(config):
    """The language-model part of a config (multimodal models nest it as `text_config`)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else getattr(config, "text_config", None) or config


def _language_modules(model: nn.Module, attrs: tuple[str, ...]) -> list[nn.Module]:
    """The submodules `model.<attr>` that exist, each followed by its `language_model` where it has one (the text
    model inside a multimodal wrapper)."""
    modules = []
    for attr in attrs:
        sub = getattr(model, attr, None)
        if sub is not None:
            modules.append(sub)
            inner = getattr(sub, "language_model", None)
            if inner is not None:
                modules.append(inner)
    return modules


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of a transformers causal LM (Llama/Qwen/Mistral/Gemma/Phi style and others)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    candidates = ([decoder] if decoder is not None else []) + _language_modules(
        model, ("model", "transformer", "gpt_neox", "language_model")) + [model]
    for module in candidates:
        for attr in ("layers", "h", "blocks", "decoder_layers"):
            layers = getattr(module, attr, None)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return layers
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}; DFlash needs a decoder-only model")


def find_final_norm(model: nn.Module) -> nn.Module | None:
    """The final norm of the language model (also inside a multimodal model: `model.language_model.norm`)."""
    for module in _language_modules(model, ("model", "transformer")):
        for attr in ("norm", "ln_f", "final_layernorm"):
            norm = getattr(module, attr, None)
            if isinstance(norm, nn.Module):
                return norm
    return None


class TargetModel:
    """A transformers causal LM plus hooks that capture the hidden states of the tapped layers."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None):
        self.model = model
        self.config = text_config(model.config)
        self.layers = find_decoder_layers(model)
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.embedding_weight = model.get_input_embeddings().weight
        self.lm_head = model.get_output_embeddings()
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self._capturing = False
        self.layer_ids: list[int] = []
        self.set_layer_ids(layer_ids or [])

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight.dtype

    def set_layer_ids(self, layer_ids: list[int]) -> None:
        """Tap these layers (the hooks of the previous ones are removed first)."""
        self.remove_hooks()
        self.layer_ids = [int(i) for i in layer_ids]
        for layer_id in self.layer_ids:
            if not 0 <= layer_id < self.num_layers:
                raise PairMismatchError(
                    f"target_layer_ids: layer {layer_id} is outside the target's {self.num_layers} layers (0..{self.num_layers - 1})"
                )
            # transformers applies the final norm to hidden_states[L]; tap the norm for the last layer to match.
            final_norm = find_final_norm(self.model) if layer_id == self.num_layers - 1 else None
            module = final_norm if final_norm is not None else self.layers[layer_id]
            self._hooks.append(module.register_forward_hook(self._capture_hook(layer_id)))

    def remove_hooks(self) -> None:
        """Take every capture hook off the model and tap no layer (`set_layer_ids` taps again)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.layer_ids = []

    def _capture_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self._capturing:
                self._captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values,
        logits_to_keep: int = 0,
        capture: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [b, n or logits_to_keep, V] and tapped features [b, n, len(layer_ids) * H] (None if not captured)."""
        self._captured.clear()
        self._capturing = capture and bool(self.layer_ids)
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        finally:
            capturing, self._capturing = self._capturing, False
        if not capturing:
            return out.logits, None
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return out.logits, features


def validate_pair(drafter, target: TargetModel) -> None:
    """Refuse a drafter that cannot work with `target`, naming the field and both values."""
    cfg = drafter.config
    checks = [
        ("hidden_size", int(getattr(cfg, "target_hidden_size", None) or cfg.hidden_size), target.hidden_size),
    ]
    # a drafter config that states no vocabulary (transformers' own assistant configs) is not checked against it
    draft_vocab = getattr(cfg, "vocab_size", None) if getattr(cfg, "vocab_size_declared", True) else None
    if draft_vocab is not None:
        checks.append(("vocab_size", int(draft_vocab), target.vocab_size))
    for name, drafter_value, target_value in checks:
        if drafter_value != target_value:
            raise PairMismatchError(
                f"drafter/target mismatch on {name}: drafter has {drafter_value}, target has {target_value}"
            )
    expected_layers = getattr(cfg, "num_target_layers", None)
    if expected_layers is not None and int(expected_layers) != target.num_layers:
        raise PairMismatchError(
            f"drafter/target mismatch on num_target_layers: drafter was built for {expected_layers}, "
            f"target has {target.num_layers}"
        )
    for layer_id in drafter.target_layer_ids:
        if not 0 <= layer_id < target.num_layers:
            raise PairMismatchError(
                f"drafter/target mismatch on target_layer_ids: {drafter.target_layer_ids} includes {layer_id}, "
                f"target has layers 0..{target.num_layers - 1}"
            )
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise PairMismatchError(
            f"drafter/target mismatch on mask_token_id: drafter has {drafter.mask_token_id}, "
            f"target vocab_size is {target.vocab_size}"
        )
    expected_in = len(drafter.target_layer_ids) * target.hidden_size
    if drafter.fc.in_features != expected_in:
        raise PairMismatchError(
            f"drafter/target mismatch on fc.in_features: drafter has {drafter.fc.in_features}, "
            f"target needs {expected_in} ({len(drafter.target_layer_ids)} taps x hidden {target.hidden_size})"
        )
