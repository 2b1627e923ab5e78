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
    make_draft_config,
)

SELECTOR_FIELDS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
# ours, for drafters trained here (z-lab publishes checkpoints, not the values they trained with)
DEFAULT_DFLASH2 = {"selector_rank": 32, "selector_top_k": 8, "conv_kernel_size": 4, "conv_group_size": 64}
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def dynamic_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, segment: int) -> torch.Tensor:
    """x [b, q, H] holding q / segment blocks of `segment` positions each; dynamic [b, q, K, G] (one weight per
    position, tap and channel group); base [K, H]. out[t] = sum_s (base[s] + dynamic[t, s]) * x[t - s] inside each
    block, zeros before its start. Accumulated tap by tap, static then dynamic term (z-lab's order of rounding)."""
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
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return dynamic_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], segment), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, segment: int) -> torch.Tensor:
        return dynamic_causal_conv(x, dynamic, self.base_kernel[1], segment)


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
        return x + self.mlp_conv.finish(self.mlp(h), kernel, self.segment)


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

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, choose) -> dict:
        """Walk the block: hidden [b, k, H] and logits [b, k, V] of the k draft positions, anchor [b] the bonus
        token. `choose(i, scores [b, top_k], candidates [b, top_k]) -> index [b]` picks at position i. Returns
        tokens [b, k], candidates [b, k, top_k] and their scores [b, k, top_k] (as chosen along the walk).

        The pair scores of every (candidate at i-1, candidate at i) are computed up front in one batched product,
        so the sequential walk is a gather and a choice per position (k tiny steps instead of k small products)."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        query = self.hidden_projection(hidden)
        successors = self.successor_codebook(candidates)  # [b, k, top_k, r]
        first = unary[:, 0] + self.pair_scores(query[:, 0], anchor, candidates[:, 0])
        # [b, k-1, top_k (previous position's candidate), top_k (this position's)]
        pairs = torch.einsum("bipr,biqr->bipq", self.predecessor_codebook(candidates[:, :-1]) * query[:, 1:, None],
                             successors[:, 1:])
        tokens, scores, row_scores = [], [], first
        for i in range(hidden.shape[1]):
            if i:
                row_scores = unary[:, i] + pairs[:, i - 1].gather(
                    1, index[:, None, None].expand(-1, 1, self.top_k))[:, 0]
            index = choose(i, row_scores, candidates[:, i])
            tokens.append(candidates[:, i].gather(-1, index[:, None])[:, 0])
            scores.append(row_scores)
        return {"tokens": torch.stack(tokens, 1), "candidates": candidates, "scores": torch.stack(scores, 1)}

    def teacher_forced(self, hidden: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor,
                       labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training: for M slots whose previous token is the true one, the scores [M, top_k] over the marginal's
        top-k (its logits detached: this trains the pair term), the label's index among them [M] and whether it is
        among them at all [M] (where it is not, the selector has no choice to learn)."""
        unary, candidates = torch.topk(logits.detach(), self.top_k, dim=-1)
        hit = candidates == labels[:, None]
        scores = unary + self.pair_scores(self.hidden_projection(hidden), previous, candidates)
        return scores, hit.float().argmax(-1), hit.any(-1)


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

    def _blocks(self, noise_embedding, position_ids, ctx_kv, context_positions, context_valid, attention_mask):
        # one block per row when drafting (no explicit mask); training lays out whole blocks of block_size
        segment = noise_embedding.shape[1] if attention_mask is None else self.block_size
        for layer in self.layers:
            layer.segment = segment
        return super()._blocks(noise_embedding, position_ids, ctx_kv, context_positions, context_valid,
                               attention_mask)

    def select(self, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor, choose) -> dict:
        """The selector's walk over draft hidden states [b, k, H] (`CandidateSelector.select`), with the marginal
        logits [b, k, V] it started from under "logits"."""
        logits = self.compute_logits(hidden, lm_head)
        out = self.candidate_selector.select(hidden.to(self.dtype), logits, anchor, choose)
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
