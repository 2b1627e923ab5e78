"""The DFlash2 drafter: DFlash-1 layers wrapped in grouped dynamic causal convolutions, plus a candidate selector
that walks the block left to right choosing each token among the top-k of its position's marginal.

Design (docs/design.md, 'DFlash2'), the architecture z-lab's `dflash` 0.1.0 package calls `DFlash2DraftModel`:
- Every draft layer is a DFlash-1 layer (`drafter.DFlashDecoderLayer`, context K/V injection, bidirectional block
  attention) whose attention and MLP each sit between two convolutions over the block's positions: the normed input
  is convolved before the sublayer, the sublayer's output after it, then added to the residual. A convolution is
  causal along the block (position i mixes positions i, i-1, ..., i-K+1 of the SAME block, zeros before its
  start), depthwise with a static kernel per channel (`base_kernel[0]` before, `[1]` after) plus a dynamic one per
  group of `conv_group_size` channels that the normed input predicts (`kernel_projection`, both halves from the
  same input). Context features are not convolved. Ours initialises the convolutions to the identity (a fresh
  DFlash2 drafter computes what its DFlash-1 layers compute).
- The candidate selector: at block position i the marginal's top-k tokens are the candidates; candidate c scores
  `logit(c) + <predecessor_codebook[prev] * hidden_projection(h_i), successor_codebook[c]>`, where prev is the token
  chosen at i-1 (the bonus token at i = 1). Greedy takes the argmax of the scores; sampling draws from
  q_i = softmax(scores / T) over the candidates, the draft distribution the verifier is given.
- Checkpoints: z-lab's layout (config `architectures: ["DFlash2DraftModel"]`, `dflash_config.{selector_rank,
  selector_top_k, conv_kernel_size, conv_group_size}` beside the DFlash-1 fields, the two codebooks stored WITHOUT a
  `.weight` suffix). Both spellings of the codebooks load; we save theirs. No remote code is written (the
  `dflash.py` beside DFlash-1 exports runs DFlash-1 only).

What this module does not know about: how the engine samples (it passes `choose` functions to `select`, see
`engine/dflash2_proposer.py`) and how the selector is trained (`train/selector.py`).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.model.drafter import (
    DFLASH2_ARCHITECTURE,
    CheckpointError,
    DFlashDecoderLayer,
    DFlashDraftModel,
    _dflash_value,
    derived_weights,
    gated_mlp,
    make_draft_config,
    records_grad,
)

SELECTOR_FIELDS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
# ours, for drafters trained here (z-lab publishes checkpoints, not the values they trained with)
DEFAULT_DFLASH2 = {"selector_rank": 32, "selector_top_k": 8, "conv_kernel_size": 4, "conv_group_size": 64}
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# parts of weight names only DFlash2 has (a DFlash-1 drafter can start a DFlash2 training without them)
DFLASH2_ONLY = (".attention_conv.", ".mlp_conv.", "candidate_selector.")


def tap_by_tap_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, segment: int) -> torch.Tensor:
    """`dynamic_causal_conv` accumulated tap by tap, static then dynamic term (z-lab's loop and order of rounding):
    every operator moves x-sized tensors only, which is what training (long batches, autograd) wants."""
    b, q, hidden = x.shape
    taps, groups = dynamic.shape[-2:]
    blocks = x.reshape(b * q // segment, segment, groups, hidden // groups)
    padded = F.pad(blocks, (0, 0, 0, 0, taps - 1, 0))  # zeros before each block; tap s reads a shifted view
    dynamic = dynamic.reshape(b * q // segment, segment, taps, groups, 1)
    base = base.view(taps, groups, -1).to(x.dtype)
    out = torch.addcmul(base[0] * blocks, dynamic[:, :, 0], blocks)
    for shift in range(1, taps):
        past = padded[:, taps - 1 - shift:taps - 1 - shift + segment]
        out = torch.addcmul(out + base[shift] * past, dynamic[:, :, shift], past)
    return out.reshape(b, q, hidden)


def drafting_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype drafting computes the convolutions and the selector's walk in: float32, or wider inputs' own (both
    are a few thousand products per block, and on CPUs bf16 elementwise arithmetic and GEMMs this small cost more
    than float32's: a 16 x 256 x 32 projection ~40 us against ~12 us on one thread)."""
    return torch.promote_types(dtype, torch.float32)


def windowed_conv(x: torch.Tensor, kernels: torch.Tensor, segment: int,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [b, q, H] holding q / segment blocks of `segment` positions each, convolved causally inside each block with
    kernels [b * q / segment, segment, K, G, H / G] (one per position, taps in REVERSE order, the order the windows
    hold them, in `drafting_dtype`): one product and one sum over a windowed view of the zero-padded blocks, in the
    kernels' dtype, rounded once to `dtype` (x's by default)."""
    b, q, hidden = x.shape
    taps, groups = kernels.shape[-3:-1]
    blocks = x.to(kernels.dtype).reshape(b * q // segment, segment, groups, hidden // groups)
    # windows[n, t, j] = position t - (taps - 1) + j of block n (zeros before its start), which tap taps - 1 - j reads
    windows = torch.constant_pad_nd(blocks, (0, 0, 0, 0, taps - 1, 0)).unfold(1, taps, 1).permute(0, 1, 4, 2, 3)
    return (kernels * windows).sum(2).to(dtype or x.dtype).reshape(b, q, hidden)


def dynamic_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, segment: int) -> torch.Tensor:
    """x [b, q, H] holding q / segment blocks of `segment` positions each; dynamic [b, q, K, G] (one weight per
    position, tap and channel group); base [K, H]. out[t] = sum_s (base[s] + dynamic[t, s]) * x[t - s] inside each
    block, zeros before its start.

    Two ways, equal up to rounding (tests/test_dflash2.py): under autograd (training) z-lab's tap-by-tap loop
    (`tap_by_tap_conv`), otherwise (drafting) one product and one sum over a windowed view of the blocks
    (`windowed_conv`): drafting convolves 16 positions at a time, where the loop's ~13 small operators per call cost
    more than their arithmetic, while the windowed form's K-times larger tensors would slow training's long batches
    (fwd + bwd 3-4x). The windowed form computes in float32 and rounds once, where the loop rounds after every tap:
    in half precision it is the closer of the two to the exact result."""
    if dynamic.requires_grad or x.requires_grad:
        return tap_by_tap_conv(x, dynamic, base, segment)
    taps, groups = dynamic.shape[-2:]
    dtype = drafting_dtype(x.dtype)
    kernels = base.to(dtype).view(taps, groups, -1) + dynamic.to(dtype).reshape(-1, segment, taps, groups, 1)
    return windowed_conv(x, kernels.flip(-3), segment)


def top_k(x: torch.Tensor, k: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x, k, dim=-1)` (values sorted, largest first) over a wide last dimension, on CPU through the
    k blocks of `block` entries with the largest maxima: they hold the k largest values (a block with a larger
    maximum than the k-th largest value has one of the larger values in it, so there are fewer than k such blocks,
    and the blocks whose maximum equals it hold enough of the tied values), and the top-k of k * block entries
    costs a fraction of the top-k of the whole row (a drafted block's bf16 logits [15, 8192] on one thread:
    ~0.26 ms -> ~0.15 ms eager, less compiled). The values are torch.topk's; which of several tied entries are
    returned may differ, as it does between torch's own CPU and CUDA kernels. Other devices and narrow rows use
    torch.topk."""
    width = x.shape[-1]
    if x.device.type != "cpu" or width % block or width < 4 * k * block:
        return torch.topk(x, k, dim=-1)
    # in float32 (exact): CPU reductions over half-precision values are not vectorised
    blocks = x.float().unflatten(-1, (width // block, block))
    chosen = blocks.amax(-1).topk(k, dim=-1).indices  # [..., k] blocks
    entries = blocks.gather(-2, chosen[..., None].expand(*chosen.shape, block)).flatten(-2)
    values, index = entries.topk(k, dim=-1)
    return values.to(x.dtype), chosen.gather(-1, index // block) * block + index % block


def follow(steps: torch.Tensor) -> torch.Tensor:
    """The path through per-position choice maps: steps [b, k, m] holds, for each position i and each index p
    chosen at i - 1, the index chosen at i (position 0's map is constant). Returns the chosen indices [b, k].

    The maps are composed in log2(k) rounds (a prefix scan: after the round with shift d, map i is the composition
    of maps i - 2d + 1 .. i), each one gather, instead of k dependent steps."""
    steps, shift = steps.clone(), 1
    while shift < steps.shape[1]:
        steps[:, shift:] = steps[:, shift:].gather(-1, steps[:, :-shift])  # the gather reads before the write
        shift *= 2
    return steps[:, :, 0]


class DynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: `prepare` convolves its input and returns the dynamic kernel
    that `finish` applies to its output (both predicted from the sublayer's normed input)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden_size % group_size:
            raise CheckpointError(f"conv_kernel_size {kernel_size} / conv_group_size {group_size}: need both >= 1 and "
                                  f"the group size to divide hidden_size {hidden_size}")
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset_identity(self) -> None:
        """The identity convolution: static tap 0 is one, everything else zero."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x convolved, and what `finish` convolves with: drafting builds both convolutions' kernels here at once
        (one projection and one sum for the pair, in `drafting_dtype`, from weights kept with their taps reversed:
        `drafting_weights`); training passes the dynamic half on (`dynamic_causal_conv` says why the two differ)."""
        if records_grad(x, self.kernel_projection.weight):
            dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
            return (tap_by_tap_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], segment),
                    dynamic[..., 1, :, :])
        projection, base = self.drafting_weights()
        wide = x.to(projection.dtype)
        dynamic = F.linear(wide, projection).view(-1, segment, 2, self.kernel_size, self.groups, 1)
        kernels = base + dynamic  # [n, segment, 2, K, G, H / G]
        return windowed_conv(wide, kernels[:, :, 0], segment, x.dtype), kernels[:, :, 1]

    def finish(self, x: torch.Tensor, kernel: torch.Tensor, segment: int) -> torch.Tensor:
        if kernel.requires_grad:  # the dynamic half (training)
            return tap_by_tap_conv(x, kernel, self.base_kernel[1], segment)
        return windowed_conv(x, kernel, segment)

    def drafting_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel projection [2 * K * G, H] and the static kernels [2, K, G, H / G], taps reversed, in
        `drafting_dtype` (cached: `derived_weights`)."""
        taps, groups = self.kernel_size, self.groups

        def build(projection, base):
            dtype = drafting_dtype(projection.dtype)
            projection = projection.view(2, taps, groups, -1).flip(1).reshape(2 * taps * groups, -1)
            return projection.to(dtype), base.flip(1).to(dtype).view(2, taps, groups, -1)

        return derived_weights(self, "_drafting_weights", [self.kernel_projection.weight, self.base_kernel], build)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash-1 layer with a convolution pair around its attention and around its MLP. `segment` (the block
    length the convolutions restart at) is set by the model before each forward."""

    def __init__(self, config, layer_idx: int, kernel_size: int, group_size: int):
        super().__init__(config, layer_idx)
        self.attention_conv = DynamicCausalConv(config.hidden_size, kernel_size, group_size)
        self.mlp_conv = DynamicCausalConv(config.hidden_size, kernel_size, group_size)
        self.segment = 1

    def forward(self, x, ctx_kv, cos, sin, mask):
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x), self.segment)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx_kv, cos, sin, mask), kernel, self.segment)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x), self.segment)
        return x + self.mlp_conv.finish(gated_mlp(self.mlp, h), kernel, self.segment)


class CandidateSelector(nn.Module):
    """Chooses each block position's token among the top-k of its marginal, conditioned on the previous choice
    through a rank-`rank` bilinear score (docs/design.md, 'DFlash2')."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or not 1 <= top_k <= vocab_size:
            raise CheckpointError(f"selector_rank {rank} / selector_top_k {top_k}: need rank >= 1 and "
                                  f"1 <= top_k <= vocab_size {vocab_size}")
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def pair_scores(self, query: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """query [..., r] (projected hidden state), previous [...] token ids, candidates [..., k] -> [..., k]."""
        return torch.einsum("...r,...kr->...k", self.predecessor_codebook(previous) * query,
                            self.successor_codebook(candidates))

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, choose,
               with_scores: bool = True, narrow_to: int | None = None,
               ranking: torch.Tensor | None = None) -> dict:
        """Walk the block: hidden [b, k, H] and logits [b, k, V] of the k draft positions, anchor [b] the bonus
        token. `choose(scores [b, k, top_k, top_k], candidates [b, k, top_k]) -> [b, k, top_k]` picks, at every
        position i and for every candidate p that position i-1 may have chosen, an index among position i's
        candidates from the scores row [b, i, p] (position 0's rows all follow the anchor). Returns tokens [b, k],
        candidates [b, k, top_k] (None where every token is a candidate: then in vocabulary order) and,
        `with_scores`, their scores [b, k, top_k] (the rows the walk went through).

        The walk is the sequential left-to-right choice z-lab's `select` makes, computed without a loop over
        positions: every row of pair scores in one batched product, every choice in one call, then the chosen
        path by composing the per-position maps (`follow`). Eager drafting pays per operator; a loop is ~6 of them
        per position. With every token a candidate (`whole_vocabulary`) the rows would be [V x V] per position: that
        walk goes position by position (`_walk_vocabulary`).

        `narrow_to` narrows the candidates at drafting time to each position's `narrow_to` best by `ranking` [b, k,
        V] (default: the logits) and walks among them in one batch; the unary scores stay the logits."""
        if narrow_to is None and self.whole_vocabulary:
            return self._walk_vocabulary(hidden, logits, anchor, choose, with_scores)
        width = min(narrow_to or self.top_k, self.top_k)
        if ranking is None:
            unary, candidates = top_k(logits, width)
        else:
            candidates = top_k(ranking, width)[1]
            unary = logits.gather(-1, candidates)
        projection, predecessor_codebook, successor_codebook = self.drafting_weights()
        query = F.linear(hidden.to(projection.dtype), projection)
        # who can precede each position's candidates: the anchor at 0, the previous position's candidates after
        previous = torch.cat([anchor[:, None, None].expand(-1, 1, width), candidates[:, :-1]], 1)
        predecessors = F.embedding(previous, predecessor_codebook) * query[:, :, None]  # [b, k, previous, r]
        successors = F.embedding(candidates, successor_codebook)  # [b, k, candidate, r]
        if torch.compiler.is_compiling():  # one fused reduction with what follows, not an external bmm call
            pairs = (predecessors[:, :, :, None] * successors[:, :, None]).sum(-1)
        else:
            pairs = torch.matmul(predecessors, successors.transpose(-1, -2))
        rows = unary[:, :, None] + pairs
        index = follow(choose(rows, candidates))  # rows: [b, k, previous candidate, candidate]
        walk = {"tokens": candidates.gather(-1, index[..., None])[..., 0], "candidates": candidates}
        if with_scores:
            came_from = F.pad(index[:, :-1], (1, 0))  # position 0's rows are all alike: any one will do
            walk["scores"] = rows.gather(2, came_from[:, :, None, None].expand(-1, -1, 1, width))[:, :, 0]
        return walk

    @property
    def whole_vocabulary(self) -> bool:
        """Every token is a candidate (`selector_top_k` = the vocabulary): the selector's distribution is the
        marginal corrected by the previous token over the whole vocabulary, not only among the marginal's top-k (at
        temperature 1 a flat target often samples outside a top-k, where such a selector cannot draft)."""
        return self.top_k >= self.successor_codebook.num_embeddings

    def _walk_vocabulary(self, hidden, logits, anchor, choose, with_scores: bool) -> dict:
        """`select` with every token a candidate, in vocabulary order: per position, the scores of all tokens given
        the token chosen before it (one fused [r] x [r, V] product onto the marginal's logits), then its choice,
        left to right; `choose` gets one position at a time (`at`) and candidates None. The rows are kept only
        `with_scores`. (Guessing every predecessor at once and repeating until no choice changes, a fixed
        point iteration, took 12 rounds of 15 on a trained drafter: each changed choice changes the next.)"""
        projection, predecessor_codebook, _ = self.drafting_weights()
        # [r, V] laid out as the product reads it: through a transposed view it took 4x as long on CPU
        successors = derived_weights(self, "_successors_by_rank", [self.successor_codebook.weight],
                                     lambda w: w.T.to(drafting_dtype(w.dtype)).contiguous())
        query = F.linear(hidden.to(projection.dtype), projection)  # [b, k, r]
        logits = logits.to(projection.dtype)
        b, k, vocab = logits.shape
        tokens, previous = anchor.new_empty(b, k), anchor
        walk = {"tokens": tokens, "candidates": None}
        if with_scores:
            walk["scores"] = torch.empty_like(logits)
        for i in range(k):
            row = torch.addmm(logits[:, i], predecessor_codebook[previous] * query[:, i], successors)
            if with_scores:
                walk["scores"][:, i] = row
            previous = tokens[:, i] = choose(row[:, None, None], None, at=i)[:, 0, 0]
        return walk

    def drafting_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hidden projection and the two codebooks in `drafting_dtype` (cached: `derived_weights`)."""
        weights = [self.hidden_projection.weight, self.predecessor_codebook.weight, self.successor_codebook.weight]
        return derived_weights(self, "_drafting_weights", weights,
                               lambda *w: tuple(t.to(drafting_dtype(t.dtype)) for t in w))

    def teacher_forced(self, hidden: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor,
                       labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Training: for M slots whose previous token is the true one, the scores [M, top_k] over the marginal's
        top-k (its logits detached: this trains the pair term), the label's index among them [M], whether it is
        among them at all [M] (where it is not, the selector has no choice to learn) and the candidates [M, top_k].
        With every token a candidate the scores are over the vocabulary in its order ([M, V]; the label is its own
        index; candidates None)."""
        if self.whole_vocabulary:
            query = self.predecessor_codebook(previous) * self.hidden_projection(hidden)
            pairs = query @ self.successor_codebook.weight.T
            return logits.detach() + pairs, labels, torch.ones_like(labels, dtype=torch.bool), None
        unary, candidates = torch.topk(logits.detach(), self.top_k, dim=-1)
        hit = candidates == labels[:, None]
        scores = unary + self.pair_scores(self.hidden_projection(hidden), previous, candidates)
        return scores, hit.float().argmax(-1), hit.any(-1), candidates


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash2 drafter. See the module docstring for the design; everything else is `DFlashDraftModel`'s."""

    ARCHITECTURE = DFLASH2_ARCHITECTURE

    def __init__(self, config, own_embedding: bool = False, own_lm_head: bool = False, mask_embedding: bool = False):
        values = {}
        for name in SELECTOR_FIELDS:
            value = _dflash_value(config, name)
            if value is None:
                raise CheckpointError(f"a DFlash2 drafter config needs dflash_config.{name}")
            values[name] = int(value)
        super().__init__(config, own_embedding, own_lm_head, mask_embedding)
        self.layers = nn.ModuleList(
            DFlash2DecoderLayer(config, i, values["conv_kernel_size"], values["conv_group_size"])
            for i in range(config.num_hidden_layers))
        vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        if vocab != int(config.vocab_size):
            raise CheckpointError("a reduced draft vocabulary (draft_vocab_size) is not supported with DFlash2")
        self.candidate_selector = CandidateSelector(vocab, config.hidden_size, values["selector_rank"],
                                                    values["selector_top_k"])
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        """DFlash-1's initialisation, identity convolutions, and codebooks at 1/sqrt(rank) so that the selector's
        bilinear term starts small but learns at once (both factors tiny would stall it)."""
        super().reset_parameters(std)
        for module in self.modules():
            if isinstance(module, DynamicCausalConv):
                module.reset_identity()
        selector = getattr(self, "candidate_selector", None)
        if selector is not None:
            rank = selector.hidden_projection.out_features
            for codebook in (selector.predecessor_codebook, selector.successor_codebook):
                nn.init.normal_(codebook.weight, std=rank ** -0.5)

    def _blocks(self, noise_embedding, position_ids, ctx_kv, context_positions, context_valid, attention_mask,
                starts: dict | None = None):
        # one block per row when drafting (no explicit mask); training lays out whole blocks of block_size
        segment = noise_embedding.shape[1] if attention_mask is None else self.block_size
        for layer in self.layers:
            layer.segment = segment
        return super()._blocks(noise_embedding, position_ids, ctx_kv, context_positions, context_valid,
                               attention_mask, starts)

    def select(self, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor, choose,
               with_scores: bool = True, logits: torch.Tensor | None = None, narrow_to: int | None = None,
               ranking: torch.Tensor | None = None) -> dict:
        """The selector's walk over draft hidden states [b, k, H] (`CandidateSelector.select`, which says what
        `narrow_to` and `ranking` do), with the marginal logits [b, k, V] it started from (`logits`, when the
        caller has them already) under "logits"."""
        if logits is None:
            logits = self.compute_logits(hidden, lm_head)
        out = self.candidate_selector.select(hidden.to(self.dtype), logits, anchor, choose, with_scores,
                                             narrow_to, ranking)
        out["logits"] = logits
        return out

    # ---- checkpoint format ----------------------------------------------------------------------------------

    def checkpoint_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """z-lab's names: the codebooks without `.weight`."""
        return {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k: v for k, v in state.items()}

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        state = {f"{k}.weight" if k in CODEBOOKS else k: v for k, v in state.items()}
        super().load_checkpoint_state(state, source)

    def export_config(self, dtype: torch.dtype | None = None) -> dict:
        cfg = super().export_config(dtype)
        cfg.pop("auto_map", None)
        selector = self.candidate_selector
        conv = self.layers[0].attention_conv
        cfg["dflash_config"].update(
            selector_rank=selector.hidden_projection.out_features, selector_top_k=selector.top_k,
            conv_kernel_size=conv.kernel_size, conv_group_size=self.config.hidden_size // conv.groups)
        for name in ("output_multiplier", "final_logit_softcapping"):
            value = _dflash_value(self.config, name)
            if value is not None:
                cfg["dflash_config"][name] = value
            cfg.pop(name, None)
        return cfg


def make_dflash2_config(target_config, selector_rank: int | None = None, selector_top_k: int | None = None,
                        conv_kernel_size: int | None = None, conv_group_size: int | None = None, **kwargs):
    """A DFlash2 drafter config for `target_config` (`make_draft_config`'s arguments, plus the DFlash2 fields;
    those left None take `DEFAULT_DFLASH2`, the group size at most the hidden size)."""
    config = make_draft_config(target_config, **kwargs)
    chosen = {"selector_rank": selector_rank, "selector_top_k": selector_top_k, "conv_kernel_size": conv_kernel_size,
              "conv_group_size": conv_group_size}
    for name, value in chosen.items():
        if value is None:
            value = DEFAULT_DFLASH2[name]
            if name == "conv_group_size":
                value = min(value, config.hidden_size)
        config.dflash_config[name] = int(value)
    config.architectures = [DFLASH2_ARCHITECTURE]
    del config.auto_map
    return config


def is_dflash2_checkpoint(config_path) -> bool:
    """Whether the config.json at `config_path` names the DFlash2 architecture."""
    try:
        raw = json.loads(open(config_path).read())
    except (OSError, ValueError):
        return False  # the loader reports it
    return isinstance(raw, dict) and DFLASH2_ARCHITECTURE in (raw.get("architectures") or [])
