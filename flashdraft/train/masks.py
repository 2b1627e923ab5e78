"""The training attention mask: many blocks of one sequence in one drafter pass (docs/design.md, 'Training').

Layout (the drafter's explicit-mask convention): queries are the Q = N * B block slots of a row (N blocks of B),
keys are `[T context slots ; the Q block slots]`. Context slot c holds the target features of position c.
- a query of block j sees context slot c iff c < anchor_j (strictly before its anchor) and c is a real position;
- it sees block slots of its own block only, bidirectionally (causally with `is_causal=True`, for drafters whose
  config sets `is_causal`); blocks never see each other;
- `sliding_window` (optional) additionally limits context to `anchor_j + k - c < window`, as the drafter's
  sliding layers do at inference.
- `segments` (optional, [b, T], packed rows: `packing.py`) additionally limits context to slots of the anchor's
  own example (segment id equal); -1 marks padding.
Every query sees at least its own slot, so padding blocks never produce an all-masked row (no NaN).

Two builds of the same predicate, both vectorised:
- `dense_training_mask`: boolean [b, 1, Q, T + Q] for `F.scaled_dot_product_attention` (works everywhere; memory
  is O(Q * (T + Q)) per row, fine for short sequences and tests);
- `flex_training_mask`: a FlexAttention `BlockMask` (sparse; what long sequences need on GPU). CPU FlexAttention
  runs forward only (no backward) and eagerly, so `flex_supported` says no for CPU training.

What this module does not know about: the anchors (`anchors.py`) and the model; which layers slide (the trainer
builds one mask per distinct (window, causal) of the drafter's layers).
"""

from __future__ import annotations

import torch


def dense_training_mask(
    anchors: torch.Tensor,
    context_valid: torch.Tensor,
    block_size: int,
    is_causal: bool = False,
    sliding_window: int | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [b, 1, Q, T + Q], True = attend. anchors [b, N]; context_valid [b, T] bool."""
    b, n = anchors.shape
    t = context_valid.shape[1]
    dev = anchors.device
    q = n * block_size
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    ctx_pos = torch.arange(t, device=dev)
    ctx = (ctx_pos[None, None, :] < q_anchor[:, :, None]) & context_valid.bool()[:, None, :]
    if segments is not None:
        ctx = ctx & (segments[:, None, :] == segments.gather(1, q_anchor.clamp(max=t - 1))[:, :, None])
    q_idx = torch.arange(q, device=dev)
    blk = (q_idx[:, None] // block_size) == (q_idx[None, :] // block_size)
    if is_causal:
        blk = blk & (q_idx[None, :] <= q_idx[:, None])
    if sliding_window is not None:
        q_pos = q_anchor + (q_idx % block_size)[None, :]
        ctx = ctx & (q_pos[:, :, None] - ctx_pos[None, None, :] < sliding_window)
        blk = blk & ((q_idx[:, None] % block_size - q_idx[None, :] % block_size).abs() < sliding_window)
    return torch.cat([ctx, blk[None].expand(b, q, q)], dim=2)[:, None]


def flex_supported(device: torch.device | str, need_backward: bool = True) -> bool:
    """Whether FlexAttention can be used on `device` (CPU: forward only)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and not need_backward


def flex_training_mask(
    anchors: torch.Tensor,
    context_valid: torch.Tensor,
    block_size: int,
    is_causal: bool = False,
    sliding_window: int | None = None,
    block_sparsity: int = 128,
    segments: torch.Tensor | None = None,
):
    """The same predicate as `dense_training_mask` as a FlexAttention BlockMask over [b, 1, Q, T + Q]."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    t = context_valid.shape[1]
    q = n * block_size
    q_anchor = anchors.repeat_interleave(block_size, dim=1).contiguous()
    valid = context_valid.bool().contiguous()
    window = sliding_window
    seg = segments.contiguous() if segments is not None else None

    def mask_mod(bi, hi, qi, ki):
        a = q_anchor[bi, qi]
        is_ctx = ki < t
        kc = ki.clamp(max=t - 1)
        ctx_ok = is_ctx & (ki < a) & valid[bi, kc]
        if seg is not None:
            ctx_ok = ctx_ok & (seg[bi, kc] == seg[bi, a.clamp(max=t - 1)])
        kb = (ki - t).clamp(min=0)
        blk_ok = (~is_ctx) & (kb // block_size == qi // block_size)
        if is_causal:
            blk_ok = blk_ok & (kb <= qi)
        if window is not None:
            ctx_ok = ctx_ok & (a + qi % block_size - ki < window)
            blk_ok = blk_ok & ((qi % block_size - kb % block_size).abs() < window)
        return ctx_ok | blk_ok

    return create_block_mask(mask_mod, b, None, q, t + q, device=str(anchors.device), BLOCK_SIZE=block_sparsity)


def training_mask(
    kind: str,
    anchors: torch.Tensor,
    context_valid: torch.Tensor,
    block_size: int,
    is_causal: bool = False,
    sliding_window: int | None = None,
    segments: torch.Tensor | None = None,
):
    """`kind` is "sdpa" (dense bool) or "flex" (BlockMask)."""
    if kind == "flex":
        return flex_training_mask(anchors, context_valid, block_size, is_causal, sliding_window, segments=segments)
    if kind == "sdpa":
        return dense_training_mask(anchors, context_valid, block_size, is_causal, sliding_window, segments)
    raise ValueError(f"unknown attention kind {kind!r}; use 'sdpa' or 'flex'")


def resolve_attention(kind: str, device: torch.device | str, need_backward: bool = True) -> str:
    """'auto' picks flex where it trains (CUDA) and sdpa elsewhere; an explicit 'flex' that cannot run falls back."""
    if kind not in ("auto", "sdpa", "flex"):
        raise ValueError(f"attention must be auto, sdpa or flex, got {kind!r}")
    if kind == "sdpa":
        return "sdpa"
    return "flex" if flex_supported(device, need_backward) else "sdpa"
