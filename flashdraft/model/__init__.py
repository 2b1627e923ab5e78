"""Models: the DFlash drafter (`drafter.py`), the DFlash2 drafter (`dflash2.py`) and the view of a transformers
target they draft for (`target.py`)."""

from flashdraft.model.drafter import (
    CheckpointError,
    DFlashDraftModel,
    default_target_layer_ids,
    make_draft_config,
)
from flashdraft.model.dflash2 import DFlash2DraftModel, make_dflash2_config
from flashdraft.model.target import PairMismatchError, TargetModel, validate_pair

__all__ = [
    "CheckpointError",
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "PairMismatchError",
    "TargetModel",
    "default_target_layer_ids",
    "make_dflash2_config",
    "make_draft_config",
    "validate_pair",
]
