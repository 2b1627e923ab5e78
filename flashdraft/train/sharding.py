"""A frozen target sharded over the training processes with FSDP2, so targets larger than one device can be trained
against (docs/design.md, 'Training at real sizes').

Design:
- `shard_frozen_target` applies `torch.distributed.fsdp.fully_shard` to every decoder layer of the target (each
  process keeps 1/W of each layer's weights, dim-0 shards), then once more to the whole model with everything
  outside the layers passed as `ignored_params`, so the root holds no weights of its own. The embedding, the
  final norm and the lm_head stay whole on every process: the drafter embeds its blocks with the target's
  embedding and reads its logits through the target's lm_head in its own forward and backward every step, so it
  needs them whole anyway (and they are a few percent of an 8B-70B model).
- The target is frozen and runs under `torch.no_grad()`: each layer's forward all-gathers that layer's weights,
  runs, and frees them again (`reshard_after_forward=True`); there is no backward through the target, so no
  gradient reduce-scatter. Every process must therefore run the same number of target forwards in the same order
  (the trainer's micro-batches do: grad_accum per step on every rank); inputs may differ in shape.
- The drafter is not sharded: it is small and trained data-parallel beside the target (DDP), as without sharding.
- `load_sharded_target` never holds the whole target anywhere: the model is built on the meta device, sharded,
  materialised on the device (`to_empty`: each process allocates its shards and the whole embedding / norm /
  lm_head), then filled from the checkpoint's safetensors files, each process reading only its rows of every layer
  weight (`get_slice`), one tensor at a time. Rotary tables (buffers computed at construction, not stored) are
  computed again on the device; any other buffer the checkpoint lacks is refused by name.
- `parameter_bytes_per_process` counts the bytes of weights one process holds (a DTensor counts its local
  shard), which is what `scripts/memory/fsdp_target.py` reports for an 8B-shaped target built on the meta device.

What this module does not know about: hub downloads (meta loading reads a local directory; a target passed in
memory is sharded from its whole weights), checkpoints whose tensor names differ from the model's own, tensor
parallelism, the engine's fast path (it reads whole weights, so a sharded target cannot run the tau evaluation;
the trainer refuses that combination), and the drafter.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdraft.model.target import find_decoder_layers


def shard_frozen_target(model: nn.Module, device: torch.device, world_size: int, mesh=None) -> nn.Module:
    """Shard the decoder layers of `model` (in place) over a 1-D mesh of `world_size` processes on `device`'s
    type; everything else is moved to `device` whole. Returns `model`. The default process group must be up."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh(device.type, (world_size,))
    layers = find_decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    in_layers = {id(p) for p in layers.parameters()}
    whole = {p for p in model.parameters() if id(p) not in in_layers}
    fully_shard(model, mesh=mesh, ignored_params=whole)
    for p in whole:  # ignored parameters are left where they were (on the meta device: `to_empty` places them)
        if not p.is_meta:
            p.data = p.data.to(device)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if not buf.is_meta:
                module._buffers[name] = buf.to(device)
    return model


def load_sharded_target(path, device: torch.device, world_size: int, rank: int, dtype: torch.dtype):
    """(model, tokenizer): the frozen target of the local directory `path`, sharded over `world_size` processes
    without ever being whole in one (see the module docstring). Errors name the tensor or file at fault."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from flashdraft.loading import check_finite_weights, check_model_path, load_tokenizer

    local = check_model_path(path, "target")
    files = sorted(local.glob("*.safetensors")) if local is not None else []
    if not files:
        raise ValueError(f"--target {path}: --shard-target reads the weights from a local directory of safetensors "
                         "files (download the model first)")
    config = AutoConfig.from_pretrained(str(local))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    shard_frozen_target(model, device, world_size)
    model.to_empty(device=device)
    model.tie_weights()  # `to_empty` unties: tied embeddings are one parameter again, read once as stored
    _fill_from_safetensors(model, files, rank, world_size, dtype, str(path))
    check_finite_weights(model, f"--target {path}")  # this process's shards and the whole tensors
    return model, load_tokenizer(local)


def _fill_from_safetensors(model: nn.Module, files, rank: int, world_size: int, dtype: torch.dtype,
                           what: str) -> None:
    from safetensors import safe_open

    wanted = dict(model.named_parameters())
    wanted.update((name, buf) for name, buf in model.named_buffers() if name not in _computed_buffers(model))
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = wanted.pop(name, None)
                    if tensor is not None:
                        _copy_rows(tensor, f.get_slice(name), rank, world_size, dtype, f"{what}: {name}")
        if wanted:
            missing = sorted(wanted)
            raise ValueError(f"--target {what}: the checkpoint lacks {', '.join(missing[:4])}"
                             f"{' ...' if len(missing) > 4 else ''}; load it without --shard-target")
        _compute_rotary_tables(model)


def _copy_rows(tensor: torch.Tensor, source, rank: int, world_size: int, dtype: torch.dtype, what: str) -> None:
    """Copy this process's part of a checkpoint tensor into `tensor`: its dim-0 shard (FSDP2's `Shard(0)`, chunks
    of ceil(rows / world_size)) for a sharded parameter, all of it otherwise."""
    shape = tuple(source.get_shape())
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if hasattr(tensor, "to_local"):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{what}: checkpoint shape {shape}, model shape {tuple(tensor.shape)}")
        chunk = -(-shape[0] // world_size)
        start = min(shape[0], rank * chunk)
        rows = source[start:min(shape[0], start + chunk)]
    else:
        rows = source[:]
    if tuple(rows.shape) != tuple(local.shape):
        raise ValueError(f"{what}: checkpoint gives {tuple(rows.shape)} here, the model holds {tuple(local.shape)}")
    local.copy_(rows.to(local.dtype if local.is_floating_point() else rows.dtype))


def _rotary_modules(model: nn.Module):
    return [m for m in model.modules() if hasattr(m, "rope_type") and isinstance(getattr(m, "inv_freq", None),
                                                                                 torch.Tensor)]


def _computed_buffers(model: nn.Module) -> set[str]:
    rotary = {id(m) for m in _rotary_modules(model)}
    return {f"{name}.{b}" if name else b for name, m in model.named_modules() if id(m) in rotary
            for b, _ in m.named_buffers(recurse=False)}


def _compute_rotary_tables(model: nn.Module) -> None:
    """Rotary inverse frequencies, as transformers computes them at construction, on the model's device."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for module in _rotary_modules(model):
        fn = (module.compute_default_rope_parameters if module.rope_type == "default"
              else ROPE_INIT_FUNCTIONS[module.rope_type])
        inv_freq, scaling = fn(module.config, device=module.inv_freq.device)
        module.inv_freq = inv_freq.to(module.inv_freq.device)
        if hasattr(module, "original_inv_freq"):
            module.original_inv_freq = inv_freq.clone().to(module.inv_freq.device)
        module.attention_scaling = scaling


def local_numel(p: torch.Tensor) -> int:
    """Elements this process holds of `p` (its shard for a DTensor)."""
    to_local = getattr(p, "to_local", None)
    return int(to_local().numel() if to_local is not None else p.numel())


def parameter_bytes_per_process(model: nn.Module) -> int:
    """Bytes of weights this process holds (the local shard of sharded ones, the whole of the others)."""
    return sum(local_numel(p) * p.element_size() for p in model.parameters())
