"""Loading targets, drafters and the shipped default pair.

`load_target` loads any transformers causal LM (local directory or hub id) with its tokenizer; `load_pair` adds
the drafter and validates the pair. With no paths, the default pair shipped in `flashdraft/assets/default_pair`
(a small Python-code model and its DFlash drafter, trained by this project's own pipeline) is used, so everything
runs offline on a fresh machine; `DFLASH2_DRAFTER` is a DFlash2 drafter for the same target (higher tau, a costlier
draft step on CPU; its model card).

What this module does not know about: quantisation and device maps (pass a preloaded model to SpecEngine instead).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from flashdraft.model.cpu_linear import native_bf16_cpu

DEFAULT_PAIR_DIR = Path(__file__).parent / "assets" / "default_pair"
DEFAULT_TARGET = DEFAULT_PAIR_DIR / "target"
DEFAULT_DRAFTER = DEFAULT_PAIR_DIR / "drafter"
DFLASH2_DRAFTER = DEFAULT_PAIR_DIR / "drafter_dflash2"


class DefaultPairMissing(FileNotFoundError):
    pass


def resolve_device(device: str | None) -> str:
    """'auto' -> cuda when available, else cpu. Anything else is checked: an unknown device, or CUDA / MPS on a
    machine without them, is a ValueError naming the device (not a traceback from deep inside torch)."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"device {device!r}: CUDA is not available on this machine ({why}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {device!r}: MPS is not available on this machine")
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    return str(device)


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype]


# a repository id on the hub: "name" or "org/name" (letters, digits, - _ .), never a path-looking string
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
# files any transformers tokenizer is loaded from; a local directory with none of them has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def check_model_path(path: str | Path, what: str = "target") -> Path | None:
    """The local directory `path` names, or None when it is a hub id ("org/name") to be downloaded.

    A path that does not exist and cannot be a hub id (it starts with / . ~, or has more than one /) is a
    FileNotFoundError; an existing path that is not a model directory (a file, no config.json) a ValueError."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"--{what} {path}: is a file; a model is a directory with config.json")
        if not (p / "config.json").is_file():
            raise ValueError(f"--{what} {path}: no config.json; not a model directory")
        return p
    text = str(path)
    if text.startswith(("/", ".", "~")) or not _HUB_ID.match(text):
        raise FileNotFoundError(f"--{what} {path}: no such directory (and not a hub id of the form org/name)")
    return None


def load_tokenizer(path: str | Path):
    """The tokenizer saved with a model, or None when the model has none. A local directory without any tokenizer
    file has none; a tokenizer that is present but cannot be loaded (corrupt tokenizer.json ...) is a ValueError."""
    from transformers import AutoTokenizer

    local = check_model_path(path)
    if local is not None and not any((local / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(local or path))
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        raise ValueError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {_first_line(exc)})") from exc


def load_target(path: str | Path, device: str | None = None, dtype: str | torch.dtype | None = None):
    """A transformers causal LM in eval mode and its tokenizer (None if the checkpoint has none).

    Refused with a one-line ValueError / FileNotFoundError: a path that is neither a model directory nor a hub id,
    a DFlash drafter directory, a checkpoint that cannot be read (truncated safetensors, ...), a checkpoint
    missing weights that transformers would otherwise initialise at random, and weights holding NaN or inf
    (named; `check_finite_weights`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    local = check_model_path(path, "target")
    if local is not None:
        try:
            config = json.loads((local / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}/config.json: cannot parse ({_first_line(exc)})") from exc
        if isinstance(config, dict) and (config.get("dflash_config") or "DFlashDraftModel" in
                                         (config.get("architectures") or [])):
            raise ValueError(f"--target {path}: this is a DFlash drafter checkpoint, not a target model "
                             "(pass it as --draft)")
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # missing weights are reported below, as one error
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # no carriage-return bars in logs (and errors stay one line)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(local or path), dtype=torch_dtype,
                                                           output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - OSError, safetensors errors, size mismatches: one line, not swallowed
        where = "" if local is not None else " (not a local directory; tried the hub)"
        raise ValueError(f"--target {path}: cannot load the model{where}: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" ... ({len(missing)} in all)" if len(missing) > 4 else "")
        raise ValueError(f"--target {path}: the checkpoint lacks weights the model needs ({shown}); refusing to "
                         "run with randomly initialised ones")
    model = model.to(device).eval()
    check_finite_weights(model, f"--target {path}")  # on the device: one read of the weights at its bandwidth
    return model, load_tokenizer(local or path)


def nonfinite_parameter(module: torch.nn.Module) -> str | None:
    """The name of the first floating-point parameter of `module` holding a NaN or an inf, or None.

    One `torch.aminmax` per weight (NaN propagates to both results, +-inf shows as the max / min): a single
    vectorised read with no temporary the size of the weight, and one device sync per tensor. Measured on a
    2-core CPU: ~9-10 GB/s for fp32 and bf16, where `torch.isfinite(w).all()` reads 0.2-0.6 GB/s (it builds a
    boolean tensor first). A corrupt checkpoint otherwise surfaces much later as empty text, all-zero
    regenerated answers or a NaN loss."""
    for name, param in module.named_parameters():
        if not param.is_floating_point() or param.numel() == 0:
            continue
        weight = param.detach()
        try:
            ok = bool(torch.isfinite(torch.stack(torch.aminmax(weight))).all())
        except (RuntimeError, NotImplementedError):  # a dtype without aminmax (float8 ...): the plain check
            ok = bool(torch.isfinite(weight).all())
        if not ok:
            return name
    return None


def check_finite_weights(module: torch.nn.Module, what: str) -> None:
    """ValueError naming the first parameter of `module` that holds a NaN or an inf (`what`: '--target DIR' ...)."""
    name = nonfinite_parameter(module)
    if name is not None:
        raise ValueError(f"{what}: weight {name} contains NaN or inf (a corrupt or diverged checkpoint); refusing "
                         "to run with it")


def default_pair_paths() -> tuple[Path, Path]:
    if not (DEFAULT_TARGET / "config.json").is_file():
        raise DefaultPairMissing(f"no default model shipped yet: {DEFAULT_TARGET} is missing; pass --target/--draft")
    if not (DEFAULT_DRAFTER / "config.json").is_file():
        raise DefaultPairMissing(f"no default drafter shipped yet: {DEFAULT_DRAFTER} is missing; pass --draft")
    return DEFAULT_TARGET, DEFAULT_DRAFTER


def resolve_draft_dtype(draft_dtype: str | torch.dtype | None, target_dtype: torch.dtype, device: str) -> torch.dtype:
    """The drafter's dtype. 'auto': the target's, except bf16 for an fp32 target on a CPU with native bf16.

    Drafts only steer how many tokens are accepted, never which: the verifier alone decides the output, so a
    lower-precision drafter is still lossless."""
    if draft_dtype in (None, "auto"):
        if device == "cpu" and target_dtype == torch.float32 and native_bf16_cpu():
            return torch.bfloat16
        return target_dtype
    return resolve_dtype(draft_dtype, device)


def load_drafter(path: str | Path, dtype: torch.dtype | None = None, device: str | None = None):
    """A drafter checkpoint as the class its config.json names: `DFlash2DraftModel` for z-lab's DFlash2
    architecture, `DFlashDraftModel` for every other (DFlash-1 variants, docs/checkpoints.md)."""
    from flashdraft.model import DFlash2DraftModel, DFlashDraftModel
    from flashdraft.model.dflash2 import is_dflash2_checkpoint
    from flashdraft.model.drafter import _resolve_checkpoint_dir

    config = _resolve_checkpoint_dir(path, weights=False) / "config.json"  # a hub id: its JSON files only
    cls = DFlash2DraftModel if is_dflash2_checkpoint(config) else DFlashDraftModel
    return cls.from_pretrained(path, dtype=dtype, device=device)


def load_pair(target: str | Path | None = None, draft: str | Path | None = None, device: str | None = None,
              dtype: str | torch.dtype | None = None, draft_dtype: str | torch.dtype | None = None):
    """(target model, tokenizer, drafter or None). No target and no draft: the shipped default pair."""
    from flashdraft.model import TargetModel, validate_pair

    if target is None:
        default_target, default_drafter = default_pair_paths()
        target, draft = default_target, draft or default_drafter
    device = resolve_device(device)
    model, tokenizer = load_target(target, device, dtype)
    drafter = None
    if draft is not None:
        drafter = load_drafter(draft, dtype=resolve_draft_dtype(draft_dtype, model.dtype, device),
                                                   device=device)
        validate_pair(drafter, TargetModel(model))
    return model, tokenizer, drafter
