"""Offline target-feature cache: the tapped hidden states of every training example, in safetensors shards.

Design: example i lives in shard `i // shard_size` (`features-{k:05d}.safetensors`, key `str(i)`, tensor
[T_i, n_taps * H] in the target's dtype). Shards are written to a `.tmp` file and renamed, so a present shard is
complete and a killed build resumes. Under DDP, rank r builds shards r, r + W, ... and all ranks wait for the
rest. `meta.json` records what the cache was computed for (layer ids, example count and lengths); opening a cache
built for something else is refused.

What this module does not know about: target logits (distillation needs them, so it runs online), eviction, and
disk size: a cache holds T * n_taps * H values per example, which is large for real models (roughly 125 MB per
3K-token example of an 8B target with 5 taps in bf16); online features are the default for that reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class FeatureCache:
    def __init__(self, directory: str | Path, shard_size: int = 256):
        self.dir = Path(directory)
        self.shard_size = shard_size
        self._open: tuple[int, object] | None = None

    def shard_file(self, k: int) -> Path:
        return self.dir / f"features-{k:05d}.safetensors"

    def _meta(self, layer_ids, examples) -> dict:
        return {"layer_ids": list(layer_ids), "num_examples": len(examples), "shard_size": self.shard_size,
                "total_tokens": int(sum(len(e) for e in examples))}

    def build(self, target, examples, rank: int = 0, world_size: int = 1, batch_size: int = 4, barrier=None,
              progress: bool = False) -> None:
        """Compute the missing shards this rank owns (target: a `TargetModel` with the right layer ids)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self._meta(target.layer_ids, examples)
        meta_path = self.dir / "meta.json"
        if meta_path.exists():
            found = json.loads(meta_path.read_text())
            if found != meta:
                raise ValueError(f"{self.dir}: feature cache was built for {found}, not {meta}; use another directory")
        num_shards = (len(examples) + self.shard_size - 1) // self.shard_size
        for k in range(rank, num_shards, world_size):
            if self.shard_file(k).exists():
                continue
            tensors = {}
            idx = list(range(k * self.shard_size, min(len(examples), (k + 1) * self.shard_size)))
            for s in range(0, len(idx), batch_size):
                chunk = idx[s:s + batch_size]
                feats = target_features(target, [examples[i].input_ids for i in chunk])[0]
                for j, i in enumerate(chunk):
                    tensors[str(i)] = feats[j, : len(examples[i])].contiguous().cpu()
            tmp = self.shard_file(k).with_suffix(".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, self.shard_file(k))
        if rank == 0:
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta))
            os.replace(tmp, meta_path)
        if barrier is not None:
            barrier()

    def get(self, index: int) -> torch.Tensor:
        k = index // self.shard_size
        if self._open is None or self._open[0] != k:
            self._open = (k, safe_open(str(self.shard_file(k)), framework="pt"))
        return self._open[1].get_tensor(str(index))


def pad_batch(seqs: list[torch.Tensor], pad_value=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors to [b, T_max]; returns (padded, valid mask)."""
    t = max(int(s.shape[0]) for s in seqs)
    out = torch.full((len(seqs), t), pad_value, dtype=seqs[0].dtype)
    valid = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
        valid[i, : s.shape[0]] = True
    return out, valid


@torch.no_grad()
def target_features(target, seqs: list[torch.Tensor] | None, keep_logits: bool = False, packed=None):
    """(features [b, T, n_taps*H] with padding zeroed, logits [b, T, V] or None, valid [b, T]) for right-padded seqs,
    or for a `packing.PackedBatch` (its examples attend only within themselves, at their own positions)."""
    dev = target.device
    if packed is None:
        ids, valid = pad_batch(seqs)
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        mask = valid.long()
    else:
        from flashdraft.train.packing import segment_causal_mask

        ids, valid, pos = packed.input_ids, packed.valid, packed.positions
        mask = segment_causal_mask(packed.segments, target.dtype)
    ids, valid, pos, mask = ids.to(dev), valid.to(dev), pos.to(dev), mask.to(dev)
    logits, feats = target.forward(ids, pos, mask, None, logits_to_keep=0 if keep_logits else 1, capture=True)
    feats = feats.masked_fill(~valid[..., None], 0.0)
    return feats, (logits if keep_logits else None), valid
