"""flashdraft: lossless speculative decoding with block-diffusion (DFlash) drafters for Hugging Face models."""

from flashdraft.engine import EngineConfig, GenerationResult, RequestStats, SamplingParams, SpecEngine
from flashdraft.model import (
    CheckpointError,
    DFlashDraftModel,
    PairMismatchError,
    TargetModel,
    default_target_layer_ids,
    make_draft_config,
    validate_pair,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "DFlashDraftModel",
    "EngineConfig",
    "GenerationResult",
    "PairMismatchError",
    "RequestStats",
    "SamplingParams",
    "SpecEngine",
    "TargetModel",
    "default_target_layer_ids",
    "make_draft_config",
    "validate_pair",
]
