"""Loading targets, drafters and the shipped default pair.

`load_target` loads any transformers causal LM (local directory or hub id) with its tokenizer; `load_pair` adds
the drafter and validates the pair. With no paths, the default pair shipped in `flashdraft/assets/default_pair`
(a small Python-code model and its drafter, trained by this project's own pipeline) is used, so everything runs
offline on a fresh machine.

What this module does not know about: quantisation and device maps (pass a preloaded model to SpecEngine instead).
"""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_PAIR_DIR = Path(__file__).parent / "assets" / "default_pair"
DEFAULT_TARGET = DEFAULT_PAIR_DIR / "target"
DEFAULT_DRAFTER = DEFAULT_PAIR_DIR / "drafter"


class DefaultPairMissing(FileNotFoundError):
    pass


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


def load_target(path: str | Path, device: str | None = None, dtype: str | torch.dtype | None = None):
    """A transformers causal LM in eval mode and its tokenizer (None if the checkpoint has none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, device)).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception:
        tokenizer = None
    return model, tokenizer


def default_pair_paths() -> tuple[Path, Path]:
    if not (DEFAULT_TARGET / "config.json").is_file():
        raise DefaultPairMissing(f"no default model shipped yet: {DEFAULT_TARGET} is missing; pass --target/--draft")
    if not (DEFAULT_DRAFTER / "config.json").is_file():
        raise DefaultPairMissing(f"no default drafter shipped yet: {DEFAULT_DRAFTER} is missing; pass --draft")
    return DEFAULT_TARGET, DEFAULT_DRAFTER


def native_bf16_cpu() -> bool:
    """True if this CPU multiplies bf16 natively (AVX512-BF16 / AMX), where bf16 matmuls beat fp32 several times."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_draft_dtype(draft_dtype: str | torch.dtype | None, target_dtype: torch.dtype, device: str) -> torch.dtype:
    """The drafter's dtype. 'auto': the target's, except bf16 for an fp32 target on a CPU with native bf16.

    Drafts only steer how many tokens are accepted, never which: the verifier alone decides the output, so a
    lower-precision drafter is still lossless."""
    if draft_dtype in (None, "auto"):
        if device == "cpu" and target_dtype == torch.float32 and native_bf16_cpu():
            return torch.bfloat16
        return target_dtype
    return resolve_dtype(draft_dtype, device)


def load_pair(target: str | Path | None = None, draft: str | Path | None = None, device: str | None = None,
              dtype: str | torch.dtype | None = None, draft_dtype: str | torch.dtype | None = None):
    """(target model, tokenizer, drafter or None). No target and no draft: the shipped default pair."""
    from flashdraft.model import DFlashDraftModel, TargetModel, validate_pair

    if target is None:
        default_target, default_drafter = default_pair_paths()
        target, draft = default_target, draft or default_drafter
    device = resolve_device(device)
    model, tokenizer = load_target(target, device, dtype)
    drafter = None
    if draft is not None:
        drafter = DFlashDraftModel.from_pretrained(draft, dtype=resolve_draft_dtype(draft_dtype, model.dtype, device),
                                                   device=device)
        validate_pair(drafter, TargetModel(model))
    return model, tokenizer, drafter
