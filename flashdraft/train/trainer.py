"""The DFlash training loop (docs/design.md, 'Training'): frozen target, online (or cached) features, many blocks per pass.

Design:
- The target is loaded once per rank, frozen; its input embedding and lm_head are used (frozen, not copied) to
  embed blocks and read out logits. Only the drafter (layers, fc, norms) is optimised: AdamW, linear warmup
  (`warmup_ratio`) then cosine to zero, grad-norm clip, gradient accumulation, bf16 autocast on CUDA.
- Features: online by default (a no-grad target forward with layer hooks inside each micro-step); with
  `feature_cache` they are computed once into safetensors shards (`features.py`) and read back.
- Rows: one example each, or with `pack_sequences` several consecutive examples back to back in rows of up to
  `max_length` tokens (`packing.py`; attention never crosses examples, in the target's feature pass nor in the
  drafter's). The data order below permutes rows; anchors stay per example, so a packed row trains on exactly the
  blocks its examples give unpacked.
- Data order is a pure function of (seed, epoch, step): each epoch is a seeded permutation of the rows; global
  step s takes the permutation slice [e*G, (e+1)*G) with G = world_size * batch_size * grad_accum, laid out as
  [grad_accum, world_size, batch_size] (micro-step a of rank r takes its own slice). The last partial global batch
  of an epoch is dropped. Anchors are seeded by (seed, epoch, example index). So the data position is the step
  count: a resumed run continues with the next slice, and runs with the same global batch see the same examples
  whatever the world size / accumulation split.
- Exact large-batch gradients: before the backward passes of a step, every rank builds its micro-batches and the
  sum of label weights is all-reduced; each micro-loss is normalised by that global sum (times the world size,
  since DDP averages). Accumulation and DDP therefore give the gradient of the whole global batch at once.
- Checkpoints (`output_dir/checkpoints/step-XXXXXXXX`, every `save_every` steps and at the end) are written, listed
  and read by `checkpoint.py` (layout there): drafter weights (reference format), optimizer, scheduler, step,
  epoch, data position, RNG states per rank. `resume=True` loads the newest complete one; the log is cut back to
  that step. The final drafter is exported with `DFlashDraftModel.save_pretrained` to `output_dir/final` and its
  config is checked for every loader field.
- Non-finite values stop training: a target whose weights hold NaN / inf is refused before anything runs, and a
  step whose loss or gradient norm is not finite (summed over all ranks, so every rank agrees) raises
  `NonFiniteLoss` naming the step and its examples before the optimizer step; nothing is exported, and the
  checkpoints already written stay as they were. The export refuses a drafter with non-finite weights too.
- Evaluation: tau and per-position acceptance on held-out prompts with the real `SpecEngine` (rank 0), at start,
  every `eval_every` steps and at the end. Metrics go to `output_dir/train_log.jsonl`; tqdm on rank 0.
- `shard_target` (under torchrun): the frozen target's decoder layers are sharded over the processes with FSDP2
  (`sharding.py`; embedding, final norm and lm_head stay whole; a target given by path is built sharded from its
  safetensors files, never whole in any process), the drafter is still trained data-parallel (DDP) beside it.
  Every rank runs the same micro-batch count, so the layers' all-gathers line up. The tau evaluation and the
  feature cache need the whole target in one process, so they are refused with it. `shard_optimizer` splits the
  drafter's AdamW moments over the processes (ZeRO-1, `ZeroRedundancyOptimizer`); they are gathered on rank 0
  for each checkpoint, and a resumed run splits them again.
- Sliding-window drafters (`layer_types` / `sliding_window`): the drafter gets one training mask per distinct
  (window, causal) of its layers, the same predicate its sliding layers apply when decoding.

What this module does not know about: multi-node launch details beyond what torchrun's environment provides, and
the files of a checkpoint (`checkpoint.py` alone reads and writes them).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from flashdraft.model.draft_vocab import (copy_weights, draft_targets, reduced_config, response_token_counts,
                                          select_draft_vocab, set_draft_vocab)
from flashdraft.model.dflash2 import DFLASH2_ONLY, SELECTOR_FIELDS, DFlash2DraftModel, make_dflash2_config
from flashdraft.model.drafter import DFlashDraftModel, make_draft_config
from flashdraft.model.target import TargetModel
from flashdraft.train import checkpoint
from flashdraft.train.anchors import anchor_generator, build_blocks, candidate_anchors, pad_anchors, sample_anchors
from flashdraft.train.checkpoint import LOG_NAME, STATE_NAME  # noqa: F401  (re-exported)
from flashdraft.train.data import Example, load_examples, load_prompts
from flashdraft.train.evaluate import evaluate_tau
from flashdraft.train.features import FeatureCache, target_features
from flashdraft.train.loss import dflash_loss, gather_teacher_logits, slot_weights
from flashdraft.train.masks import resolve_attention, training_mask
from flashdraft.train.selector import selector_loss
from flashdraft.train.packing import PackedBatch, pack_batch, pack_rows

# Fields the reference loader, vLLM and SGLang read from a drafter's config.json (docs/design.md, 'Checkpoint format').
REQUIRED_CONFIG_FIELDS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size", "layer_types",
    "sliding_window", "num_target_layers", "block_size", "dflash_config",
)
REQUIRED_DFLASH_FIELDS = ("mask_token_id", "target_layer_ids", "block_size")


@dataclass
class TrainConfig:
    target: str | None = None  # path or hub id of the target (not needed when a model is passed to Trainer)
    data: str | None = None  # JSONL file / shard directory / datasets name (see data.py)
    output_dir: str = "runs/drafter"
    block_size: int = 16
    num_draft_layers: int = 5
    target_layer_ids: list[int] | None = None
    num_taps: int | None = None  # default: one tap per draft layer (the reference's choice)
    mask_token_id: int | None = None  # default: the tokenizer's mask token
    intermediate_size: int | None = None
    epochs: int = 6
    max_steps: int | None = None  # overrides epochs
    batch_size: int = 1  # sequences per micro-batch per rank
    grad_accum: int = 1
    max_length: int = 3072
    num_anchors: int = 512
    start_anchors: int = 0  # the first N blocks of every answer are always among its anchors (`anchors.py`)
    lr: float = 6e-4
    # a DFlash2 selector's learning rate (None: lr); a fresh selector on a trained drafter's layers needs a larger
    # one than their fine-tuning rate (its codebooks start from random)
    selector_lr: float | None = None
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; default from block size
    distill_weight: float = 0.0
    # a DFlash2 selector's soft-label term: per slot (1 - w) * its cross-entropy + w * KL(target || selector) over
    # its candidates, the target's distribution given the true prefix (what the selector's q should be at T = 1)
    selector_distill_weight: float = 0.0
    distill_temperature: float = 1.0
    seed: int = 0
    attention: str = "auto"  # auto | sdpa | flex
    feature_cache: str | None = None
    save_every: int = 500
    keep_checkpoints: int = 2
    eval_prompts: str | None = None
    eval_limit: int = 64
    eval_every: int = 0  # 0: only at start and end
    eval_at_start: bool = True
    eval_max_new_tokens: int = 64
    log_every: int = 1
    resume: bool = False
    device: str | None = None
    export_dtype: str | None = None  # default bfloat16 on CUDA, float32 on CPU
    loss_chunk_size: int = 4096
    progress: bool = True
    shard_target: bool = False  # FSDP2 over the target's decoder layers (torchrun); see sharding.py
    shard_optimizer: bool = False  # ZeRO-1 (torchrun): AdamW moments split over the processes
    pack_sequences: bool = False  # several examples per row of up to max_length tokens (packing.py)
    layer_types: list[str] | None = None  # per draft layer: full_attention | sliding_attention (default: all full)
    sliding_window: int | None = None  # the window of sliding_attention layers
    # read out over the N most frequent response tokens only (own lm_head + d2t, `model/draft_vocab.py`); None: all
    draft_vocab_size: int | None = None
    init_from: str | None = None  # a drafter checkpoint whose weights (all but the read-out) start the training
    arch: str = "dflash"  # dflash | dflash2 (convolutions + candidate selector, `model/dflash2.py`, `selector.py`)
    # dflash2 only; None: `model/dflash2.py: DEFAULT_DFLASH2`
    selector_rank: int | None = None
    selector_top_k: int | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None

    @property
    def distills(self) -> bool:
        """A soft-label term is on (the marginal's or the selector's): training needs the target's logits."""
        return self.distill_weight > 0 or self.selector_distill_weight > 0


class NonFiniteLoss(RuntimeError):
    """A training step produced a NaN / inf loss or gradient norm; training stopped before applying it."""


def check_config(cfg: "TrainConfig") -> None:
    """ValueError naming the first field of `cfg` out of its range (the CLI checks the same as it parses; this
    guards the Python API from ZeroDivisionError / IndexError deep inside, or a silently untrained drafter)."""
    def need(ok: bool, field_name: str, what: str) -> None:
        if not ok:
            raise ValueError(f"TrainConfig.{field_name} = {getattr(cfg, field_name)!r}: must be {what}")

    for name in ("num_draft_layers", "epochs", "batch_size", "grad_accum", "max_length", "num_anchors", "save_every",
                 "keep_checkpoints", "eval_limit", "eval_max_new_tokens", "log_every", "loss_chunk_size"):
        need(isinstance(getattr(cfg, name), int) and getattr(cfg, name) >= 1, name, "an integer >= 1")
    need(isinstance(cfg.block_size, int) and cfg.block_size >= 2, "block_size",
         "an integer >= 2 (the bonus token plus at least one draft)")
    for name in ("max_steps", "num_taps", "intermediate_size"):
        value = getattr(cfg, name)
        need(value is None or (isinstance(value, int) and value >= 1), name, "None or an integer >= 1")
    need(isinstance(cfg.eval_every, int) and cfg.eval_every >= 0, "eval_every", "an integer >= 0 (0 = at the end)")
    need(isinstance(cfg.start_anchors, int) and cfg.start_anchors >= 0, "start_anchors", "an integer >= 0")
    need(cfg.mask_token_id is None or cfg.mask_token_id >= 0, "mask_token_id", "None or >= 0")
    need(isinstance(cfg.seed, int) and 0 <= cfg.seed < 2**32, "seed", "an integer in [0, 2**32 - 1]")
    finite = math.isfinite
    need(finite(cfg.lr) and cfg.lr >= 0, "lr", "a finite number >= 0")
    need(cfg.selector_lr is None or (finite(cfg.selector_lr) and cfg.selector_lr >= 0), "selector_lr",
         "a finite number >= 0")
    need(cfg.selector_lr is None or cfg.arch == "dflash2", "selector_lr", "set only with arch 'dflash2'")
    need(finite(cfg.weight_decay) and cfg.weight_decay >= 0, "weight_decay", "a finite number >= 0")
    need(0 <= cfg.warmup_ratio <= 1, "warmup_ratio", "in [0, 1]")
    need(finite(cfg.grad_clip) and cfg.grad_clip > 0, "grad_clip", "a finite number > 0")
    need(cfg.gamma is None or (finite(cfg.gamma) and cfg.gamma > 0), "gamma", "None or a finite number > 0")
    need(0 <= cfg.distill_weight <= 1, "distill_weight", "in [0, 1]")
    need(0 <= cfg.selector_distill_weight <= 1, "selector_distill_weight", "in [0, 1]")
    need(cfg.selector_distill_weight == 0 or cfg.arch == "dflash2", "selector_distill_weight",
         "set only with arch 'dflash2'")
    need(finite(cfg.distill_temperature) and cfg.distill_temperature > 0, "distill_temperature",
         "a finite number > 0")
    need(cfg.draft_vocab_size is None or cfg.draft_vocab_size >= 1, "draft_vocab_size", "None or >= 1")
    need(cfg.arch in ("dflash", "dflash2"), "arch", "dflash or dflash2")
    for name in SELECTOR_FIELDS:
        value = getattr(cfg, name)
        need(value is None or (cfg.arch == "dflash2" and isinstance(value, int) and value >= 1), name,
             "None, or an integer >= 1 with arch dflash2")
    need(not (cfg.arch == "dflash2" and cfg.draft_vocab_size), "draft_vocab_size",
         "None with arch dflash2 (the selector's codebooks span the target's vocabulary)")
    need(not (cfg.draft_vocab_size and cfg.distill_weight > 0), "distill_weight",
         "0 with draft_vocab_size (the target's distribution has mass outside the draft vocabulary)")
    need(not (cfg.shard_target and cfg.feature_cache), "feature_cache",
         "None with shard_target (the cache is built by ranks working apart; a sharded target runs in lockstep)")
    need(not (cfg.shard_target and cfg.eval_prompts), "eval_prompts",
         "None with shard_target (the tau evaluation needs the whole target in one process: run `flashdraft bench` "
         "on the exported drafter)")
    if cfg.layer_types is not None:
        need(len(cfg.layer_types) == cfg.num_draft_layers and set(cfg.layer_types) <= {"full_attention",
             "sliding_attention"}, "layer_types", "None or one of full_attention / sliding_attention per draft layer")
    sliding = "sliding_attention" in (cfg.layer_types or [])
    need(cfg.sliding_window is None or (isinstance(cfg.sliding_window, int) and cfg.sliding_window >= 1),
         "sliding_window", "None or an integer >= 1")
    need(sliding == (cfg.sliding_window is not None), "sliding_window",
         "set exactly when layer_types has sliding_attention layers")
    if cfg.target_layer_ids is not None:
        need(len(cfg.target_layer_ids) > 0 and min(cfg.target_layer_ids) >= 0, "target_layer_ids",
             "a non-empty list of layer indices >= 0")


def resolve_mask_token_id(mask_token_id: int | None, tokenizer, vocab_size: int) -> int:
    """The explicit id, else the tokenizer's mask token; errors clearly when neither exists or it is out of range."""
    if mask_token_id is None:
        tid = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        if tid is None and tokenizer is not None:
            for name in ("<|mask|>", "<mask>", "[MASK]"):
                cand = tokenizer.convert_tokens_to_ids(name) if hasattr(tokenizer, "convert_tokens_to_ids") else None
                if isinstance(cand, int) and cand != getattr(tokenizer, "unk_token_id", None):
                    tid = cand
                    break
        if tid is None:
            raise ValueError(
                "no mask token: the target's tokenizer defines no mask token (e.g. <|mask|>). Pass --mask-token-id "
                "with the id of a token that never appears in text (a reserved/unused special token below the "
                f"target vocab size {vocab_size}); the drafter embeds it with the target's embedding.")
        mask_token_id = tid
    mask_token_id = int(mask_token_id)
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary [0, {vocab_size})")
    return mask_token_id


def check_export_config(directory: str | Path) -> list[str]:
    """The loader fields missing from an exported drafter's config.json (empty list = complete)."""
    cfg = json.loads((Path(directory) / "config.json").read_text())
    missing = [k for k in REQUIRED_CONFIG_FIELDS if k not in cfg]
    if "rope_theta" not in cfg and "rope_parameters" not in cfg:
        missing.append("rope_theta|rope_parameters")
    dcfg = cfg.get("dflash_config") or {}
    missing += [f"dflash_config.{k}" for k in REQUIRED_DFLASH_FIELDS if k not in dcfg]
    if cfg.get("architectures") not in (["DFlashDraftModel"], ["DFlash2DraftModel"]):
        missing.append("architectures=[DFlashDraftModel] or [DFlash2DraftModel]")
    return missing


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) * 7919 + int(epoch) + 1))


def _cosine_lambda(total_steps: int, warmup_steps: int):
    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return fn


@dataclass
class _Micro:
    indices: list[int]  # example indices, row after row
    blocks: object
    weights: torch.Tensor
    valid: torch.Tensor
    input_ids: torch.Tensor
    tokens: int
    rows: list[list[int]]  # the example indices of each row
    packed: PackedBatch  # the rows laid out (positions and segment ids per example)
    block_positions: torch.Tensor  # [b, Q] positions of the block slots inside their own examples


@dataclass
class TrainResult:
    steps: int
    final_dir: str | None
    log_path: str
    eval_start: dict | None = None
    eval_end: dict | None = None
    tokens_per_second: float = 0.0
    losses: list[float] = field(default_factory=list)


class Trainer:
    """trainer = Trainer(TrainConfig(...)); result = trainer.train()

    A target model / tokenizer / examples / eval prompts may be passed directly instead of paths (tests, notebooks).
    """

    def __init__(self, config: TrainConfig, target_model=None, tokenizer=None, examples: list[Example] | None = None,
                 eval_prompts: list[list[int]] | None = None):
        check_config(config)
        self.cfg = config
        self._setup_distributed()
        self.out = Path(config.output_dir)
        if (config.shard_target or config.shard_optimizer) and self.world_size == 1:
            checkpoint.warn("--shard-target / --shard-optimizer in one process: nothing to split (run it under "
                            "torchrun --nproc-per-node N)")
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        self._barrier()
        if target_model is None:
            if config.target is None:
                raise ValueError("TrainConfig.target (path to the target model) is required")
            from flashdraft.loading import load_target

            from flashdraft.loading import resolve_dtype
            from flashdraft.train.sharding import load_sharded_target

            dtype = resolve_dtype(None, str(self.device))
            if config.shard_target and self.world_size > 1:  # built sharded: never whole in any process
                target_model, loaded_tok = load_sharded_target(config.target, self.device, self.world_size,
                                                               self.rank, dtype)
            else:
                target_model, loaded_tok = load_target(config.target, device=str(self.device), dtype=dtype)
            tokenizer = tokenizer or loaded_tok  # weights checked by either loader
        else:
            from flashdraft.loading import check_finite_weights

            check_finite_weights(target_model, "target model")
        if eval_prompts and config.shard_target:
            raise ValueError("eval_prompts with shard_target: the tau evaluation needs the whole target in one "
                             "process; evaluate the exported drafter with `flashdraft bench`")
        target_model = target_model.eval()
        for p in target_model.parameters():
            p.requires_grad_(False)
        if not (config.shard_target and self.world_size > 1):
            target_model = target_model.to(self.device)
        elif not _is_sharded(target_model):  # a model passed in whole
            from flashdraft.train.sharding import shard_frozen_target

            shard_frozen_target(target_model, self.device, self.world_size)
        from flashdraft.train.sharding import parameter_bytes_per_process

        self.target_bytes_per_process = parameter_bytes_per_process(target_model)
        self.tokenizer = tokenizer
        vocab = int(target_model.get_output_embeddings().weight.shape[0])
        self.mask_token_id = resolve_mask_token_id(config.mask_token_id, tokenizer, vocab)

        torch.manual_seed(config.seed)
        make_config, drafter_class = make_draft_config, DFlashDraftModel
        if config.arch == "dflash2":
            make_config = partial(make_dflash2_config, **{name: getattr(config, name) for name in SELECTOR_FIELDS})
            drafter_class = DFlash2DraftModel
        draft_cfg = make_config(
            target_model.config, num_layers=config.num_draft_layers, block_size=config.block_size,
            mask_token_id=self.mask_token_id, target_layer_ids=config.target_layer_ids, num_taps=config.num_taps,
            intermediate_size=config.intermediate_size, layer_types=config.layer_types,
            sliding_window=config.sliding_window,
        )
        self.drafter = drafter_class(draft_cfg).to(self.device)
        self.drafter.train()
        self.target = TargetModel(target_model, self.drafter.target_layer_ids)
        # (window, causal) of every draft layer: one training mask each
        self.layer_attention = sorted({(layer.self_attn.sliding_window, layer.self_attn.is_causal)
                                       for layer in self.drafter.layers}, key=str)

        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if examples is None:
            if config.data is None:
                raise ValueError("TrainConfig.data is required")
            examples = load_examples(config.data, tokenizer, config.max_length, eos_token_id=eos)
        else:
            examples = [Example(e.input_ids[: config.max_length], e.loss_mask[: config.max_length]) for e in examples]
        self.examples = [e for e in examples if candidate_anchors(e.loss_mask, config.block_size).numel() > 0]
        if not self.examples:
            raise ValueError(f"no example has a response long enough for a block of {config.block_size}")
        if eval_prompts is None and config.eval_prompts:
            eval_prompts = load_prompts(config.eval_prompts, tokenizer, limit=config.eval_limit)
        self.eval_prompts = eval_prompts[: config.eval_limit] if eval_prompts else None
        self.stop_ids = tuple(int(i) for i in ([eos] if isinstance(eos, int) else []))

        lengths = [len(e) for e in self.examples]
        self.rows = (pack_rows(lengths, config.max_length) if config.pack_sequences
                     else [[i] for i in range(len(lengths))])
        self.global_batch = self.world_size * config.batch_size * config.grad_accum
        self.steps_per_epoch = len(self.rows) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.rows)} rows of usable examples are fewer than one global batch "
                             f"({self.world_size} ranks x {config.batch_size} x {config.grad_accum} accumulation)")
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        self.attention = resolve_attention(config.attention, self.device, need_backward=True)

        self._shape_drafter(target_model)
        self.model = self.drafter
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.drafter, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        if config.selector_lr is not None:  # the selector's parameters in a group of their own
            selector = [p for n, p in self.drafter.named_parameters() if p.requires_grad
                        and n.startswith("candidate_selector.")]
            chosen = {id(p) for p in selector}
            params = [{"params": [p for p in params if id(p) not in chosen]},
                      {"params": selector, "lr": config.selector_lr}]
        if config.shard_optimizer and self.world_size > 1:  # ZeRO-1: each rank keeps the AdamW moments of a part
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=config.lr,
                                                     weight_decay=config.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        warmup = int(math.ceil(config.warmup_ratio * self.total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _cosine_lambda(self.total_steps, warmup))
        self.step = 0
        self.feature_cache = None
        if config.feature_cache:
            if config.distills:
                raise ValueError("distillation needs target logits: use online features (no feature_cache)")
            self.feature_cache = FeatureCache(config.feature_cache)
            self.feature_cache.build(self.target, self.examples, self.rank, self.world_size, barrier=self._barrier)

    def _shape_drafter(self, target_model) -> None:
        """`draft_vocab_size`: the drafter reads out over the most frequent response tokens of the training data
        through its own lm_head, initialised with those rows of the target's; `init_from`: the weights of a trained
        drafter (all but the read-out) instead of random ones; a shallower one grows: its layers start the first
        ones and each layer added after them starts as the identity (its attention and MLP write nothing to the
        residual), so the grown drafter starts out drafting exactly what it did."""
        cfg = self.cfg
        if cfg.draft_vocab_size:
            head = target_model.get_output_embeddings().weight
            if cfg.draft_vocab_size > head.shape[0]:
                raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary "
                                 f"({head.shape[0]})")
            ids = select_draft_vocab(response_token_counts(self.examples, head.shape[0]), cfg.draft_vocab_size)
            small = DFlashDraftModel(reduced_config(self.drafter.config, ids.numel()), own_lm_head=True)
            small.to(self.device)
            copy_weights(self.drafter, small)
            set_draft_vocab(small, head, ids)
            self.drafter = small.train()
        if cfg.init_from:
            from flashdraft.loading import load_drafter

            source = load_drafter(cfg.init_from, dtype=torch.float32)
            training_dflash2 = isinstance(self.drafter, DFlash2DraftModel)
            if isinstance(source, DFlash2DraftModel) and not training_dflash2:
                raise ValueError(f"init_from {cfg.init_from} is a DFlash2 drafter: train it with arch dflash2 (a "
                                 "DFlash-1 drafter would drop its convolutions and selector)")
            have, want = len(source.layers), len(self.drafter.layers)
            if have > want:
                raise ValueError(f"init_from {cfg.init_from} has {have} draft layers, more than the {want} to train "
                                 "(--num-draft-layers)")
            # from a DFlash-1 drafter the convolutions stay the identity, so the drafter starts computing what the
            # DFlash-1 one computes, and the selector starts fresh (a DFlash2 source has all of them)
            added = tuple(f"layers.{i}." for i in range(have, want))
            copy_weights(source, self.drafter, may_lack=(DFLASH2_ONLY if training_dflash2 else ()) + added)
            with torch.no_grad():
                for layer in self.drafter.layers[have:]:  # the residual's writers: an added layer passes x through
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()

    # ---- distributed ----------------------------------------------------------------------------------------

    def _setup_distributed(self) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if self.cfg.device:
            self.device = torch.device(self.cfg.device)
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        if self.device.type == "cuda":
            if self.device.index is None:  # `--device cuda`: this rank's GPU (torch.cuda.set_device needs an index)
                self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        self._owns_process_group = self.world_size > 1 and not dist.is_initialized()
        if self._owns_process_group:
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")

    def close(self, finished: bool = False) -> None:
        """Tear down the process group this trainer started. Left to interpreter exit, gloo's threads can abort
        a rank that already finished (SIGABRT, 'terminate called without an active exception'); so can one rank
        tearing down while another still talks to it, hence the barrier first after a run every rank `finished`
        (not after an error, which the other ranks may never reach)."""
        if getattr(self, "_owns_process_group", False) and dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
            self._owns_process_group = False

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t

    # ---- data -----------------------------------------------------------------------------------------------

    def step_indices(self, step: int) -> tuple[int, int, torch.Tensor]:
        """(epoch, step in epoch, [grad_accum, world_size, batch_size] row indices) of global step `step` (a row is
        one example unless sequences are packed: `self.rows`)."""
        epoch, es = divmod(step, self.steps_per_epoch)
        perm = epoch_permutation(self.cfg.seed, epoch, len(self.rows))
        idx = perm[es * self.global_batch:(es + 1) * self.global_batch]
        return epoch, es, idx.view(self.cfg.grad_accum, self.world_size, self.cfg.batch_size)

    def _micro(self, row_indices: list[int], epoch: int) -> _Micro:
        cfg = self.cfg
        rows = [self.rows[r] for r in row_indices]
        packed = pack_batch([[self.examples[i].input_ids for i in row] for row in rows],
                            [[self.examples[i].loss_mask for i in row] for row in rows])
        # anchors per example (seeded by its index), shifted to where it starts in its row
        anchors = [torch.cat([sample_anchors(self.examples[i].loss_mask, cfg.block_size, cfg.num_anchors,
                                             anchor_generator(cfg.seed, epoch, i),
                                             start_anchors=cfg.start_anchors) + start
                              for i, start in zip(row, starts)]) for row, starts in zip(rows, packed.offsets)]
        anchors, anchor_valid = pad_anchors(anchors)
        blocks = build_blocks(packed.input_ids, packed.loss_mask, anchors, anchor_valid, cfg.block_size,
                              self.mask_token_id)
        weights = slot_weights(blocks.block_offset, blocks.label_valid, cfg.block_size, cfg.gamma)
        # the drafter sees positions inside each example; `blocks.position_ids` index the row (labels, teacher logits)
        block_positions = packed.positions.gather(1, anchors).repeat_interleave(cfg.block_size, 1) + blocks.block_offset
        return _Micro([i for row in rows for i in row], blocks, weights, packed.valid, packed.input_ids,
                      int(packed.valid.sum()), rows, packed, block_positions)

    def _features(self, micro: _Micro):
        keep_logits = self.cfg.distills
        if self.feature_cache is not None:  # an example's features do not depend on its row: concatenated
            feats, _ = _pad_features([torch.cat([self.feature_cache.get(i) for i in row]) for row in micro.rows])
            return feats.to(self.device), None
        if self.cfg.pack_sequences:
            feats, logits, _ = target_features(self.target, None, keep_logits=keep_logits, packed=micro.packed)
        else:
            feats, logits, _ = target_features(self.target, [self.examples[i].input_ids for i in micro.indices],
                                               keep_logits=keep_logits)
        return feats, logits

    def _masks(self, micro: _Micro) -> dict:
        """The drafter's training mask for each (sliding window, causal) of its layers."""
        dev = self.device
        segments = micro.packed.segments.to(dev) if self.cfg.pack_sequences else None
        return {(window, causal): training_mask(self.attention, micro.blocks.anchors.to(dev), micro.valid.to(dev),
                                                self.cfg.block_size, causal, window, segments)
                for window, causal in self.layer_attention}

    # ---- one step -------------------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        epoch, es, layout = self.step_indices(step)
        micros = [self._micro(layout[a, self.rank].tolist(), epoch) for a in range(cfg.grad_accum)]
        if self.drafter.d2t is not None:  # labels outside the draft vocabulary carry no loss: they are never drafted
            in_vocab = torch.zeros(self.drafter.config.vocab_size, dtype=torch.bool)
            in_vocab[draft_targets(self.drafter.d2t.cpu())] = True
            for m in micros:
                m.weights = m.weights * in_vocab[m.blocks.labels.cpu()].to(m.weights.device)
        local = torch.tensor([float(sum(m.weights.sum() for m in micros)), float(sum(m.tokens for m in micros))],
                             dtype=torch.float64, device=self.device)
        weight_sum, tokens = self._all_reduce(local).tolist()
        normaliser = max(weight_sum, 1e-8) / self.world_size
        stats = torch.zeros(1 + 2 * cfg.block_size, dtype=torch.float64, device=self.device)
        selector_stats = torch.zeros(2, dtype=torch.float64, device=self.device)  # DFlash2: hits, slots
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        for a, m in enumerate(micros):
            feats, tlogits = self._features(m)
            blk = m.blocks
            dev = self.device
            ctx_valid = m.valid.to(dev)
            mask = self._masks(m)
            ctx_pos = m.packed.positions.to(dev)
            sync = a == len(micros) - 1 or self.world_size == 1
            ctx_mgr = self.model.no_sync() if not sync else contextlib.nullcontext()
            with ctx_mgr, autocast:
                noise = self.drafter.embed(blk.block_ids.to(dev), self.target.embedding_weight)
                hidden = self.model(noise, m.block_positions.to(dev), feats, ctx_pos, ctx_valid, mask)
                teacher = gather_teacher_logits(tlogits, blk.position_ids.to(dev)) if tlogits is not None else None
                out = dflash_loss(
                    hidden, lambda h: self.drafter.compute_logits(h, self.target.lm_head), blk.labels.to(dev),
                    m.weights.to(dev), blk.block_offset.to(dev), cfg.block_size, normaliser=normaliser,
                    teacher_logits=teacher, distill_weight=cfg.distill_weight, temperature=cfg.distill_temperature,
                    chunk_size=cfg.loss_chunk_size, keep=isinstance(self.drafter, DFlash2DraftModel))
                loss = out.loss
                if isinstance(self.drafter, DFlash2DraftModel):  # the candidate selector's own loss (selector.py)
                    picked = selector_loss(
                        self.drafter, hidden, lambda h: self.drafter.compute_logits(h, self.target.lm_head),
                        blk.block_ids.to(dev), blk.labels.to(dev), m.weights.to(dev), blk.block_offset.to(dev),
                        normaliser, cfg.loss_chunk_size, teacher, cfg.selector_distill_weight, cfg.distill_temperature,
                        marginal=out)
                    out.logits = out.teacher_log_probs = None  # [slots x vocabulary] each: not kept past their use
                    loss = loss + picked.loss
                    selector_stats += torch.stack([picked.hits, picked.count]).double()
            loss.backward()
            stats[0] += out.weighted_sum.double()
            stats[1:1 + cfg.block_size] += out.correct.double()
            stats[1 + cfg.block_size:] += out.count.double()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        stats = self._all_reduce(stats)  # before the optimizer step: every rank sees the same (non-)finite loss
        loss = float(stats[0]) / max(weight_sum, 1e-8)
        if not (math.isfinite(loss) and math.isfinite(float(grad_norm))):
            self.optimizer.zero_grad(set_to_none=True)
            self._stop_nonfinite(step, epoch, es, loss, float(grad_norm), self._examples_of(layout))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        correct, count = stats[1:1 + cfg.block_size], stats[1 + cfg.block_size:]
        acc = [round(float(c / n), 4) if n > 0 else None for c, n in zip(correct[1:], count[1:])]
        return {"step": step + 1, "epoch": epoch, "epoch_step": es, "loss": loss,
                "lr": lr, "grad_norm": float(grad_norm), "tokens": int(tokens), "label_weight": weight_sum,
                "acc_per_position": acc, **({"selector_acc": round(float(selector_stats[0] / selector_stats[1]), 4)}
                                             if selector_stats[1] > 0 else {}), "samples": self._examples_of(layout)}

    def _examples_of(self, layout: torch.Tensor) -> list[int]:
        """The example indices of a step's rows (the rows themselves unless sequences are packed)."""
        return [i for r in layout.flatten().tolist() for i in self.rows[r]]

    def _stop_nonfinite(self, step: int, epoch: int, epoch_step: int, loss: float, grad_norm: float,
                        samples: list[int]) -> None:
        """Log and raise NonFiniteLoss for global step `step` (0-based; reported 1-based, like the log)."""
        shown = ", ".join(str(i) for i in samples[:16])
        if len(samples) > 16:
            shown += f", ... ({len(samples)} in all)"
        done = checkpoint.list_checkpoints(self.out)
        last = f"the newest checkpoint, {done[-1].name}, is untouched" if done else "no checkpoint was written"
        message = (f"step {step + 1} (epoch {epoch}, step {epoch_step + 1} of the epoch): loss {loss} and gradient "
                   f"norm {grad_norm}; not finite, so training stopped before the optimizer step and nothing was "
                   f"exported ({last}). The batch: examples [{shown}] (indices into the usable training examples "
                   "in load order). Lower --lr or check those examples.")
        if self.rank == 0:
            self._log({"event": "nonfinite", "step": step + 1, "epoch": epoch, "epoch_step": epoch_step,
                       "loss": repr(loss), "grad_norm": repr(grad_norm), "samples": samples})
        raise NonFiniteLoss(message)

    # ---- loop -----------------------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        cfg = self.cfg
        log_path = self.out / LOG_NAME
        if cfg.resume:
            self._resume()
        elif self.rank == 0 and log_path.exists():
            log_path.unlink()
        result = TrainResult(steps=self.step, final_dir=None, log_path=str(log_path))
        if self.rank == 0:
            self._log({"event": "start", "step": self.step, "total_steps": self.total_steps,
                       "steps_per_epoch": self.steps_per_epoch, "examples": len(self.examples), "rows": len(self.rows),
                       "world_size": self.world_size, "global_batch": self.global_batch, "attention": self.attention,
                       "drafter_parameters": self.drafter.num_parameters(),
                       "target_bytes_per_process": self.target_bytes_per_process, "config": asdict(cfg)})
        if cfg.eval_at_start and self.step == 0 and self.eval_prompts:
            result.eval_start = self._evaluate()
        bar = None
        if cfg.progress and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        tok_time, tok_count = 0.0, 0
        try:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                rec = self.train_step(self.step)
                dt = time.perf_counter() - t0
                self.step += 1
                tok_time += dt
                tok_count += rec["tokens"]
                rec["tokens_per_s"] = rec["tokens"] / dt if dt > 0 else 0.0
                rec["step_time_s"] = dt
                result.losses.append(rec["loss"])
                if self.rank == 0 and (self.step % cfg.log_every == 0 or self.step == self.total_steps):
                    self._log(rec)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.2e}", tok_s=f"{rec['tokens_per_s']:.0f}")
                if self.step % cfg.save_every == 0 or self.step == self.total_steps:
                    self.save_checkpoint()
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step != self.total_steps and self.eval_prompts:
                    ev = self._evaluate()
                    if bar is not None:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{ev['tau']:.2f}")
        finally:
            if bar is not None:
                bar.close()
        result.steps = self.step
        result.tokens_per_second = tok_count / tok_time if tok_time > 0 else 0.0
        result.final_dir = str(self.export())
        if self.eval_prompts:
            result.eval_end = self._evaluate()
        if self.world_size > 1 and dist.is_initialized():
            self._barrier()
        return result

    def _log(self, record: dict) -> None:
        checkpoint.append_log(self.out / LOG_NAME, record)

    def _evaluate(self) -> dict | None:
        ev = None
        if self.rank == 0:
            # its engine is closed at the end, which gives our TargetModel its layer ids (and hooks) back
            ev = evaluate_tau(self.target, self.drafter, self.eval_prompts, self.cfg.eval_max_new_tokens,
                              stop_token_ids=self.stop_ids)
            self._log({"event": "eval", "step": self.step, **ev})
        self._barrier()
        return ev

    # ---- checkpoints ----------------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return checkpoint.checkpoint_root(self.out)

    def save_checkpoint(self) -> Path:
        from flashdraft.loading import nonfinite_parameter

        if hasattr(self.optimizer, "consolidate_state_dict"):  # sharded moments: gathered on rank 0 to be saved
            self.optimizer.consolidate_state_dict(to=0)
        bad = nonfinite_parameter(self.drafter)  # an optimizer step can overflow even from a finite loss
        if bad is not None:
            raise NonFiniteLoss(f"after step {self.step} the drafter's weight {bad} holds NaN or inf (lower --lr); "
                                "not saved, nothing exported")
        return checkpoint.save_checkpoint(
            self.out, self.step, drafter=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler,
            steps_per_epoch=self.steps_per_epoch, global_batch=self.global_batch, world_size=self.world_size,
            num_examples=len(self.examples), total_steps=self.total_steps, config=asdict(self.cfg),
            keep=self.cfg.keep_checkpoints, rank=self.rank, barrier=self._barrier)

    def list_checkpoints(self) -> list[Path]:
        return checkpoint.list_checkpoints(self.out)

    def _resume(self) -> None:
        step = checkpoint.resume(self.out, drafter=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler,
                                 global_batch=self.global_batch, num_examples=len(self.examples), rank=self.rank,
                                 barrier=self._barrier)
        if step is not None:
            self.step = step

    def export(self) -> Path | None:
        out = self.out / "final"
        if self.rank == 0:
            name = self.cfg.export_dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
            from flashdraft.loading import nonfinite_parameter

            bad = nonfinite_parameter(self.drafter)
            if bad is not None:
                raise NonFiniteLoss(f"the trained drafter's weight {bad} holds NaN or inf; not exported")
            tmp = out.with_name("final.tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            self.drafter.save_pretrained(tmp, dtype=getattr(torch, name))
            missing = check_export_config(tmp)
            if missing:
                raise RuntimeError(f"exported config.json lacks loader fields: {missing}")
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
            self._log({"event": "export", "step": self.step, "path": str(out)})
        self._barrier()
        return out


def _is_sharded(model) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())


def _pad_features(feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(f.shape[0] for f in feats)
    out = feats[0].new_zeros(len(feats), t, feats[0].shape[1])
    valid = torch.zeros(len(feats), t, dtype=torch.bool)
    for i, f in enumerate(feats):
        out[i, : f.shape[0]] = f
        valid[i, : f.shape[0]] = True
    return out, valid


def train(config: TrainConfig, **kwargs) -> TrainResult:
    return Trainer(config, **kwargs).train()
