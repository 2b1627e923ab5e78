"""Compiled decode steps: `torch.compile` for the draft and verify steps, CUDA graphs on GPU.

Only the per-cycle steps are compiled - the drafter's context write and block forward, and the target's block
verify on the fast path - because their shapes are static per block size: the paged caches are attended over
every position their page tables address (masks, not slices, say which are live) and the drafter's context
arrives in chunks of one block. Prefill, acceptance and bookkeeping stay eager. Each batch bucket (the engine pads
batches to a power of two rows) compiles one graph, once; the pools' page counts and the tables' widths, which
grow with the tokens held, are dynamic dimensions of it (`PagedKV` marks them), so growing caches compile nothing
more. `SpecEngine.warmup` builds the buckets' graphs ahead of time.

On CUDA the steps use mode="reduce-overhead" (CUDA graphs). The pools and tables they read and write in place are
static addresses (`PagedKV` marks its CUDA tensors), and outputs are cloned because a graph replay overwrites its
last outputs.

What this module does not know about: which function is a step; the engine decides (`SpecEngine(compile=True)`).
"""

from __future__ import annotations

import functools
import shutil

import torch


def compile_unavailable(device: torch.device) -> str | None:
    """None if torch.compile can build kernels for `device`; otherwise why not."""
    if device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "torch.compile on CPU needs a C++ compiler (install g++), or run without --compile"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch.compile on CUDA needs triton (pip install triton)"
    if device.type not in ("cpu", "cuda"):
        return f"compiled steps are supported on cpu and cuda, not {device.type}"
    return None


MAX_GRAPHS_PER_STEP = 64  # static graphs kept per step (batch buckets x cache sizes) before falling back to eager


def compile_step(fn, device: torch.device):
    """`fn` compiled without graph breaks, one static graph per input shape; on CUDA captured as CUDA graphs
    with cloned outputs."""
    if torch._dynamo.config.recompile_limit < MAX_GRAPHS_PER_STEP:
        torch._dynamo.config.recompile_limit = MAX_GRAPHS_PER_STEP
    if device.type != "cuda":
        return torch.compile(fn, fullgraph=True, dynamic=False)
    graphed = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)

    @functools.wraps(fn)
    def step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        out = graphed(*args, **kwargs)
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    return step

