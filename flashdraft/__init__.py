"""flashdraft: lossless speculative decoding with block-diffusion (DFlash) drafters for Hugging Face models."""

from flashdraft.engine import (EngineConfig, GenerationResult, RequestStats, SamplingParams, SpecEngine,
                               StructuredOutput)
from flashdraft.model import (
    CheckpointError,
    DFlash2DraftModel,
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
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "EngineConfig",
    "GenerationResult",
    "PairMismatchError",
    "RequestStats",
    "SamplingParams",
    "SpecEngine",
    "StructuredOutput",
    "TargetModel",
    "default_target_layer_ids",
    "make_draft_config",
    "validate_pair",
]
