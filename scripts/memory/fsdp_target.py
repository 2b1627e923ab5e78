"""Weights per training process with the frozen target replicated (DDP) vs sharded (`train --shard-target`, FSDP2).

    python scripts/memory/fsdp_target.py                     # Qwen3-8B shape, 1/2/4/8 processes
    python scripts/memory/fsdp_target.py --model Llama-3.1-70B --world-sizes 8

The target is built from its config only, on the meta device (no weights, nothing allocated), and sharded with the
trainer's own `shard_frozen_target` over a fake process group of W ranks in this one process (torch's testing
`FakeStore` / "fake" backend: collectives are no-ops, sharding is real). The sharded figure is the sum of this
rank's local shards (`parameter_bytes_per_process`), measured after `fully_shard`, not computed by formula. The
drafter's training state is fp32 weights, gradients and two AdamW moments: 16 bytes per parameter on every process,
or with `--shard-optimizer` (ZeRO-1) 8 + 8 / W bytes (computed: the moments are split evenly by parameter count,
up to one parameter tensor's granularity). Activations are not counted.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from flashdraft.memory import GiB, REAL_SHAPES, real_config
from flashdraft.model.drafter import DFlashDraftModel, make_draft_config
from flashdraft.train.sharding import parameter_bytes_per_process, shard_frozen_target


def meta_target(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def sharded_bytes(config, world_size: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = meta_target(config)
        shard_frozen_target(model, torch.device("meta"), world_size, mesh=init_device_mesh("cpu", (world_size,)))
        return parameter_bytes_per_process(model)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(REAL_SHAPES), default="Qwen3-8B")
    p.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--draft-layers", type=int, default=5)
    args = p.parse_args(argv)
    config = real_config(args.model)
    replicated = parameter_bytes_per_process(meta_target(config))
    with torch.device("meta"):
        drafter = DFlashDraftModel(make_draft_config(config, num_layers=args.draft_layers, mask_token_id=0))
    drafter_state = 16 * sum(p.numel() for p in drafter.parameters())
    print(f"{args.model} (bf16 target, {args.draft_layers}-layer drafter: {drafter_state / GiB:.2f} GiB of fp32 "
          "weights + grads + AdamW moments per process; the last column splits the moments, --shard-optimizer)")
    print("| processes | target replicated (DDP), GiB/process | target sharded (FSDP2), GiB/process | "
          "total replicated | total sharded | total sharded + ZeRO-1 drafter |")
    print("|---:|---:|---:|---:|---:|---:|")
    for w in args.world_sizes:
        sharded = sharded_bytes(config, w)
        zero = drafter_state // 16 * (8 + 8 / w)
        print(f"| {w} | {replicated / GiB:.2f} | {sharded / GiB:.2f} | {(replicated + drafter_state) / GiB:.2f} | "
              f"{(sharded + drafter_state) / GiB:.2f} | {(sharded + zero) / GiB:.2f} |")


if __name__ == "__main__":
    main()
