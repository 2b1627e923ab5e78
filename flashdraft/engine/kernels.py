"""Which attention kernels the engine's forwards run on.

torch's `scaled_dot_product_attention` picks a backend per call. On CUDA with bf16, a mask and grouped KV heads it
picks cuDNN's, which plans a graph for every new shape. A one-token step's shape (one query per row) recurs; a
drafting cycle's (a block of queries over a context of a new length, in the target and in the drafter) rarely
does, so with cuDNN every drafting cycle paid a new plan: on an H200 the shipped pair's 16-position draft cost
66 ms with cuDNN's backend and 6 ms without it, and a block cycle priced 10-45 one-token steps (BENCHMARKS.md,
'cuDNN attention off on CUDA'). So on CUDA the engine's calls leave cuDNN's backend out unless asked for
(`EngineConfig.cudnn_attention`); torch then takes flash or memory-efficient attention where they apply, else
its math kernel. The choice is scoped to the engine's own calls (`sdpa_kernel` restores the process's settings
after each), so code beside the engine keeps what it chose.

What this module does not know about: which models run, or compiled graphs (they are traced inside the same scope,
so they bake in the same backends).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# every backend but cuDNN's, in torch's own order of preference
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_scope(device: torch.device, cudnn: bool):
    """A context-manager factory for the engine's forwards on `device`: no change on CPU or with `cudnn=True`."""
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext
    return functools.partial(sdpa_kernel, WITHOUT_CUDNN)


def in_attention_scope(method):
    """Runs an engine method inside the engine's attention scope (`self._attention_scope`)."""

    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with self._attention_scope():
            return method(self, *args, **kwargs)

    return scoped
