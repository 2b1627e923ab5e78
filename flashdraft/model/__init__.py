"""Models: the DFlash drafter (`drafter.py`) and the view of a transformers target it drafts for (`target.py`)."""

from flashdraft.model.drafter import (
    CheckpointError,
    DFlashDraftModel,
    default_target_layer_ids,
    make_draft_config,
)
from flashdraft.model.target import PairMismatchError, TargetModel, validate_pair

__all__ = [
    "CheckpointError",
    "DFlashDraftModel",
    "PairMismatchError",
    "TargetModel",
    "default_target_layer_ids",
    "make_draft_config",
    "validate_pair",
]
