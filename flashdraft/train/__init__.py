"""Training pipeline for DFlash drafters (docs/design.md, 'Training'): regenerate responses with the target, then train.

Modules: `data` (records -> tokenized examples), `regenerate` (the target's own responses, sharded/resumable),
`anchors` + `masks` (random blocks and the sparse training mask), `loss` (decayed CE, optional distillation),
`features` (offline feature cache), `trainer` (loop, DDP, export, tau evaluation), `checkpoint` (training
checkpoints: save, list, resume), `evaluate`, `cli` (argparse subcommands), `synthetic` (tiny targets and a learnable
corpus for tests).
"""

from flashdraft.train.anchors import BlockBatch, anchor_generator, build_blocks, candidate_anchors, sample_anchors
from flashdraft.train.checkpoint import list_checkpoints
from flashdraft.train.data import Example, build_example, encode_prompt, load_examples, load_prompts, record_to_example
from flashdraft.train.evaluate import evaluate_tau
from flashdraft.train.loss import default_gamma, dflash_loss, position_weights
from flashdraft.train.masks import dense_training_mask, flex_supported, flex_training_mask
from flashdraft.train.regenerate import regenerate
from flashdraft.train.trainer import TrainConfig, Trainer, TrainResult, check_export_config, train

__all__ = [
    "BlockBatch", "Example", "TrainConfig", "TrainResult", "Trainer", "anchor_generator", "build_blocks",
    "build_example", "candidate_anchors", "check_export_config", "default_gamma", "dense_training_mask",
    "dflash_loss", "encode_prompt", "evaluate_tau", "flex_supported", "flex_training_mask", "list_checkpoints",
    "load_examples", "load_prompts", "position_weights", "record_to_example", "regenerate", "sample_anchors", "train",
]
