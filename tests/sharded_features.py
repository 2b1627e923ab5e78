"""Run by tests/test_train_sharded.py under torchrun (2 gloo processes): a target loaded sharded from its files
(`load_sharded_target`, built on the meta device) gives the features and logits of the same target loaded whole.
argv: one or more model directories. Exits 0 when all match."""

import sys

import torch
import torch.distributed as dist

from flashdraft.loading import load_target
from flashdraft.model.target import TargetModel
from flashdraft.train.sharding import load_sharded_target, local_numel


def main(paths: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None].expand(2, 12)
    for path in paths:
        whole, _ = load_target(path, device="cpu", dtype=torch.float32)
        sharded, _ = load_sharded_target(path, torch.device("cpu"), world, rank, torch.float32)
        layer = sharded.model.layers[0].mlp.up_proj.weight
        assert local_numel(layer) < layer.numel(), "not sharded"
        out = []
        for model in (whole, sharded):
            target = TargetModel(model, [0, 2])
            with torch.no_grad():
                out.append(target.forward(ids, pos, torch.ones_like(ids), None, capture=True))
        (la, fa), (lb, fb) = out
        assert torch.allclose(fa, fb, atol=1e-5) and torch.allclose(la, lb, atol=1e-5), path
        if whole.config.tie_word_embeddings:
            assert sharded.lm_head.weight.data_ptr() == sharded.model.embed_tokens.weight.data_ptr()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
