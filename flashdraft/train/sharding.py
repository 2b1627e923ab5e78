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
- `parameter_bytes_per_process` counts the bytes of weights one process holds (a DTensor counts its local
  shard), which is what `scripts/memory/fsdp_target.py` reports for an 8B-shaped target built on the meta device.

What this module does not know about: loading weights shard by shard (the target is loaded whole on CPU by each
process and sharded onto the device layer by layer, so host RAM must hold one copy per process), tensor
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
    for p in whole:  # ignored parameters are left where they were
        p.data = p.data.to(device)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            module._buffers[name] = buf.to(device)
    return model


def local_numel(p: torch.Tensor) -> int:
    """Elements this process holds of `p` (its shard for a DTensor)."""
    to_local = getattr(p, "to_local", None)
    return int(to_local().numel() if to_local is not None else p.numel())


def parameter_bytes_per_process(model: nn.Module) -> int:
    """Bytes of weights this process holds (the local shard of sharded ones, the whole of the others)."""
    return sum(local_numel(p) * p.element_size() for p in model.parameters())
