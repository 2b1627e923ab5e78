"""A lean forward pass for the common target families (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1-3 and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) with a paged KV cache.

transformers' generic forward builds masks, dispatches attention implementations and threads many kwargs through
every layer; at small sizes and batch 1 that plumbing costs more than the arithmetic. `FastTarget` runs the same
arithmetic over the model's OWN modules and parameters (nothing is copied): embedding (Gemma's scales itself),
pre-norm layers with grouped-query attention (+ q/k RMSNorm for Qwen3 and Gemma 3, q/k/v bias for Qwen2 and gpt-oss,
Phi-3's fused q/k/v), RoPE from the model's own rotary module (so rope scaling variants match; partial rotary
dimensions as Phi-4-mini has; Gemma 3's per-layer-type frequencies; gpt-oss's half-size tables), Gemma 2's
soft-capped attention scores and logits, gpt-oss's learned attention sinks, sliding-window layers (a key at position
k is seen from position p only where k > p - window, as transformers masks them; a window's layers read only the
pages it reaches, `_window_starts`, and keep only those: `slots.GroupedKV` gives them a page table of their own), a
gated MLP with the model's own activation (Phi-3's fused gate/up), Gemma 2 / 3's norms after attention and around the
MLP, final norm, lm_head. A mixture-of-experts layer runs the model's own sparse block (its router, its experts
through the experts implementation the model was loaded with, Qwen2-MoE's shared expert, gpt-oss's experts block):
the fast path replaces the attention and cache plumbing, not the expert dispatch. A multimodal model (Gemma 3 as
`Gemma3ForConditionalGeneration`, Llava) runs its language model here: text prompts never reach its vision tower
(`language_model`).

The KV cache is paged per row (`slots.PagedKV`): position p of row r has one slot, found through the row's page
table. Writing a block scatters its K/V to the slots of its positions; a query at position p attends to
positions 0..p. Rolling back after a rejection is
therefore nothing at all - the next block overwrites the rejected slots - and rows of a batch never hold holes.

`exact=True` makes the forward batch-invariant: every generated token's logits come out bit for bit the same
whether it is computed alone (a one-token decoding step), inside a 16-token verify block, or next to other rows.
GEMM kernels pick their blocking (and so the order in which a dot product is summed) by the number of rows, and
attention kernels by the number of queries and keys, so a verify and a one-token step round differently in the
last bits; at a near-tie of the top two logits that flips a greedy token. Exact mode runs every projection one
token row at a time (the kernel a one-token step uses) and attends each query alone over exactly its own
positions 0..p, the same calls whatever the block or batch; each row's prompt is prefilled alone as one ordinary
block. Speculative output is then bit-identical to plain decoding in exact mode, in any precision; it costs speed
(BENCHMARKS.md, 'Exactness').

LongRoPE (Phi-3.5, Phi-4-mini) runs here with each position's frequency set as the model's own `generate` gives it
(`LongRope`); the engine recomputes a row's cache where its sequence outgrows the original length, as `generate`
does.

What this module does not know about: images, other architectures (M-RoPE's 3-D positions, latent attention,
chunked or linear attention layers, `dynamic` rope scaling, which grows with the largest position a model has
seen): `fast_path_unsupported` names the reason and the engine keeps the generic transformers path for them.
Expert weights are never packed for oneDNN
(only attention projections and dense MLPs are).
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import rotate_half

from flashdraft.model.cpu_linear import pack_by_default, require_packable, packed_concat, packed_linear
from flashdraft.model.greedy_readout import ScreenedArgmax
from flashdraft.model.slots import DEFAULT_PAGE_SIZE, PagedKV, new_paged_cache, window_starts
from flashdraft.model.target import TargetModel, text_config

FAST_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "mixtral",
                 "qwen2_moe", "qwen3_moe", "gpt_oss")
# the mixture-of-experts blocks `FastTarget` calls as they are: [..., tokens, H] -> the same shape (gpt-oss's: and its
# router's scores, dropped), routing per token
SPARSE_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "GptOssMLP")


def is_sparse(mlp) -> bool:
    """Whether a layer's MLP is a mixture-of-experts block (`SPARSE_BLOCKS`), run through its own forward."""
    return type(mlp).__name__ in SPARSE_BLOCKS


def gate_up_linears(mlp) -> list:
    """A gated MLP's input projections: Phi-3's fused gate/up, or the gate and the up projection."""
    return [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]


def activation(mlp):
    """A gated MLP's activation module (transformers names it `act_fn`, Phi-3 `activation_fn`)."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def qkv_linears(attn) -> list:
    """The attention's input projections: Phi-3's fused q/k/v, or q, k and v."""
    return [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]


def sparse_forward(mlp, h: torch.Tensor) -> torch.Tensor:
    """A sparse block's output for h [..., tokens, H] (gpt-oss's block also returns its router's scores)."""
    out = mlp(h)
    return out[0] if isinstance(out, tuple) else out


def _dense(mlp) -> bool:
    names = ("gate_up_proj", "down_proj") if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj", "down_proj")
    return activation(mlp) is not None and all(isinstance(getattr(mlp, p, None), torch.nn.Linear) for p in names)


def layer_windows(config, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers masks it: by `layer_types` where the
    config has them (Qwen2, Qwen3, Qwen2-MoE, Gemma 3), else `sliding_window` for every layer (Mistral, Mixtral,
    Phi-3, Qwen3-MoE)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types[:num_layers]]
    return [window] * num_layers


def rope_types(rotary) -> set:
    kinds = getattr(rotary, "rope_type", "default")
    return set(kinds.values()) if isinstance(kinds, dict) else {kinds}


def uses_long_rope(model) -> bool:
    """Whether a causal LM's rotary embedding is LongRoPE (`LongRope`)."""
    return "longrope" in rope_types(getattr(language_model(model), "rotary_emb", None))


def language_model(model):
    """The decoder stack of a causal LM (`model.model`), or of the language model inside a multimodal one
    (`model.model.language_model`: Gemma 3's, Llava's; text prompts only reach it)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", None) or inner


def fast_path_unsupported(model) -> str | None:
    """None if `FastTarget` reproduces this model's forward; otherwise why not."""
    config = text_config(model.config)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_FAMILIES:
        return f"model_type {model_type!r} is not one of {FAST_FAMILIES}"
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "mrope_section" in rope:
        return "M-RoPE (3-D positions)"
    inner = language_model(model)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "unexpected module layout"
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        return f"layer types {sorted(kinds)}"
    kinds = rope_types(inner.rotary_emb)
    if "dynamic" in kinds:  # transformers rescales by the largest position of each call, and keeps the largest seen
        return "rope type 'dynamic'"
    if "longrope" in kinds and isinstance(getattr(inner.rotary_emb, "rope_type", None), dict):
        return "rope type 'longrope' per layer type"
    for layer in inner.layers:
        attn = layer.self_attn
        if not (hasattr(attn, "qkv_proj") or all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj"))) \
                or not hasattr(attn, "o_proj"):
            return f"attention projections of {type(attn).__name__}"
        if not (_dense(layer.mlp) or is_sparse(layer.mlp)):
            return f"MLP {type(layer.mlp).__name__}: neither gated linear projections nor a known sparse block"
    return None
    return None


def untraceable_experts(model) -> str | None:
    """Why compiled steps cannot run this model's expert layers, or None: transformers' "eager" experts loop over the
    experts a batch routes to (a data-dependent loop torch.compile cannot trace without breaking the graph);
    "grouped_mm", transformers' default where it dispatches, traces."""
    implementation = getattr(model.config, "_experts_implementation", None)
    if implementation == "eager" and any(is_sparse(layer.mlp) for layer in language_model(model).layers):
        return ("compile=True cannot trace the 'eager' experts implementation this model was loaded with: load it "
                "with experts_implementation=\"grouped_mm\" or run without compile")
    return None


def packable_weights(model) -> list[torch.Tensor]:
    """The weights `FastTarget(pack_weights=True)` copies into oneDNN's layout: lm_head, q/k/v and the dense MLPs."""
    return [model.get_output_embeddings().weight] + [
        linear.weight for layer in language_model(model).layers
        for linear in qkv_linears(layer.self_attn) + (
            [] if is_sparse(layer.mlp) else gate_up_linears(layer.mlp) + [layer.mlp.down_proj])]



def resolved(offsets):
    """`offsets`, or what it returns when it is a callable: the engine passes sampled rows' race offsets that way
    while another thread is still making them (`SpecEngine._noise_soon`), and the read-out, after the layers, is
    the first to need them."""
    return offsets() if callable(offsets) else offsets


class LongRope:
    """LongRoPE tables (Phi-3.5, Phi-4-mini, Phi-3-*-128k) as the model's own `generate` applies them.

    transformers computes each call with one of two frequency sets: the long factors where the sequence (the call's
    largest position + 1) is longer than `original_max_position_embeddings`, else the short ones; and Phi-3's
    `generate` recomputes the whole cache with the long set at the step the sequence first outgrows that length.
    So the logits for position q come from every position under the set of a sequence q + 1 long. Here each
    position's set is the one of max(q + 1, floor): a decoded token's own (floor 0), a prefilled sequence's length
    for every position of it (floor n, or n + 1 for a resumed row whose next token is pending). The engine keeps a
    row's verify short of the original length until its cache is recomputed long (`SpecEngine._cross_long_rope`).
    Both tables come from the model's own rotary forward (undecorated, on a copy holding each frequency set), so they
    are its values bit for bit."""

    def __init__(self, rotary, config):
        rope = config.rope_parameters
        self.original = int(rope.get("original_max_position_embeddings")
                            or getattr(config, "original_max_position_embeddings"))
        self.forward = inspect.unwrap(type(rotary).forward)
        device = rotary.original_inv_freq.device
        long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, device, seq_len=self.original + 1)
        self.short, self.long = (self._holding(rotary, f) for f in (rotary.original_inv_freq, long_freq))

    @staticmethod
    def _holding(rotary, inv_freq: torch.Tensor):
        """A shallow copy of `rotary` whose frequencies are `inv_freq` (the model's module is left alone)."""
        module = copy.copy(rotary)
        module._buffers = {**rotary._buffers, "inv_freq": inv_freq.to(rotary.inv_freq.device)}
        return module

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, floors: torch.Tensor | None = None):
        """(cos, sin) [b, q, D] for positions [b, q]; `floors` [b, q] (None: 0): see the class docstring."""
        short, long = self.forward(self.short, x, positions), self.forward(self.long, x, positions)
        span = positions + 1 if floors is None else torch.maximum(positions + 1, floors)
        use_long = (span > self.original)[..., None]
        return torch.where(use_long, long[0], short[0]), torch.where(use_long, long[1], short[1])


class FastTarget:
    """Lean forward over a supported transformers model's own weights; see the module docstring."""

    def __init__(self, target: TargetModel, pack_weights: bool | None = None, exact: bool = False,
                 screened: ScreenedArgmax | None = None):
        reason = fast_path_unsupported(target.model)
        if reason:
            raise ValueError(f"no fast path for this model: {reason}")
        self.target = target
        inner = language_model(target.model)
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = target.model.get_output_embeddings()
        # CPU: the lm_head, the fused q/k/v and gate/up projections and the down projections (the widest GEMMs
        # of a verify) through oneDNN on packed copies; o_proj alone is as fast through MKL
        self.packed_layers = None  # per layer: (q/k/v, gate/up, down); (q/k/v, None, None) for a sparse layer
        if pack_weights is None:
            pack_weights = pack_by_default(packable_weights(target.model))
        elif pack_weights:
            require_packable(packable_weights(target.model))
        if pack_weights:
            self.lm_head = packed_linear(self.lm_head)
            self.packed_layers = [
                (packed_concat(qkv_linears(layer.self_attn)),
                 *((None, None) if is_sparse(layer.mlp) else
                   (packed_concat(gate_up_linears(layer.mlp)), packed_linear(layer.mlp.down_proj))))
                for layer in self.layers]
        cap = getattr(target.config, "final_logit_softcapping", None)
        if cap:  # Gemma 2: cap * tanh(logits / cap), as transformers' causal LM applies it
            self.lm_head = SoftCapped(self.lm_head, cap)
        self.exact = exact
        # greedy verifies read their argmax through a bf16 copy of an fp32 lm_head (`greedy_readout.py`), certified
        # to be the fp32 argmax; None: the full read-out. Exact mode keeps its per-token products
        self.screened = None if exact else screened
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        cfg = target.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.windows = layer_windows(cfg, len(self.layers))
        # Gemma 3: rotary frequencies per layer type (local and global layers); None: one set for every layer
        types = getattr(cfg, "layer_types", None)
        per_type = isinstance(getattr(self.rotary, "rope_type", None), dict)
        self.rope_keys = list(types[:len(self.layers)]) if per_type else None
        # gpt-oss: its rotary tables hold one angle per pair of halves, not the usual duplicated halves
        self.half_tables = getattr(cfg, "model_type", None) == "gpt_oss"
        # LongRoPE: each position's frequency set as the model's own generate picks it (`LongRope`)
        self.long_rope = LongRope(self.rotary, text_config(cfg)) if uses_long_rope(target.model) else None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, floors: torch.Tensor | None = None) -> list:
        """Per layer (cos, sin) [..., 1, rotary dims] for token-major heads. `floors` [b, q]: the sequence lengths
        prefilled positions belong to (None: none is); only LongRoPE reads them (`LongRope`)."""
        if self.long_rope is not None:
            cos, sin = self.long_rope(x, positions, floors)
            return [(cos[:, :, None], sin[:, :, None])] * len(self.layers)
        if self.rope_keys is None:
            cos, sin = self.rotary(x, positions)
            if self.half_tables:
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            return [(cos[:, :, None], sin[:, :, None])] * len(self.layers)
        tables = {}
        for kind in set(self.rope_keys):
            cos, sin = self.rotary(x, positions, kind)
            tables[kind] = (cos[:, :, None], sin[:, :, None])
        return [tables[kind] for kind in self.rope_keys]

    def _window_starts(self, positions: torch.Tensor, kv, exact: bool) -> dict:
        """The first key position each window's layers read (None: full attention, 0): the page boundary at or
        below the earliest position any query `positions` sees through that window. The keys before it are masked
        anyway; reading them would only cost their copy out of the pages and their attention scores (at 8k
        positions a 128-token window's layers read 3 pages of 128). 0 in exact mode (each query slices its
        own keys) and while compiling (static shapes): `slots.window_starts`."""
        return dict.fromkeys(self.windows, 0) if exact else window_starts(self.windows, positions, kv)

    def _masks(self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
               starts: dict) -> dict:
        """The layers' attention masks by window (None: `mask` itself, [b, 1, q, k]) over the keys they read, from
        `starts` (`_window_starts`) on: a window's mask also hides the keys at positions k <= p - window from a
        query at p. key_positions [b or 1, k] (None without windows)."""
        masks = {None: mask}
        for window in set(self.windows) - {None}:
            s = starts[window]
            seen = key_positions[:, None, None, s:] > query_positions[:, None, :, None] - window
            masks[window] = mask[..., s:] & seen
        return masks

    def new_cache(self, batch: int, lengths: int | list[int] = 0, page_size: int = DEFAULT_PAGE_SIZE,
                  max_pages: int | None = None) -> PagedKV:
        """A paged cache of `batch` rows with pages for `lengths` positions per row (one number: every row; a list:
        the first rows, the rest none)."""
        lengths = [lengths] * batch if isinstance(lengths, int) else lengths
        return new_paged_cache(self.windows, batch, self.num_kv_heads, self.head_dim, self.target.dtype,
                               self.target.device, page_size, lengths, max_pages)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKV,
        logit_index: torch.Tensor | None = None,
        capture: bool = True,
        key_len: int | None = None,
        exact: bool | None = None,
        greedy: bool = False,
        offsets: torch.Tensor | None = None,
        sequence_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [b, q, V] (or [b, 1, V] at `logit_index` [b] per row) and tapped features [b, q, n_taps*H];
        with `greedy` and a screened read-out (`screened`), the token ids [b, q] of the logits' argmax in their
        place (of the logits plus `offsets` [b, q, V] where given: sampled rows' race, `ScreenedArgmax`; or a
        callable returning them, called after the layers: `resolved`).

        Queries attend to positions [0, key_len) (all the cache addresses when None: static shapes for compiled
        steps); the caller guarantees every row owns pages for its positions and they are < key_len. `exact`
        overrides the instance's mode for this call (`prefill` runs each row's prompt as an ordinary block).
        `sequence_lengths` [b]: where this call prefills sequences, their lengths (`LongRope` reads them).
        """
        exact = self.exact if exact is None else exact
        b, q = input_ids.shape
        key_len = key_len or kv.capacity
        x = self.embed(input_ids)
        keys_at = torch.arange(key_len, device=x.device)
        starts = self._window_starts(positions, kv, exact)
        masks = self._masks((keys_at[None, None, :] <= positions[:, :, None])[:, None], positions, keys_at[None],
                            starts)
        slots = kv.slots(positions)
        index = {w: kv.page_index(key_len, start=s, window=w) for w, s in starts.items()}

        def attend(i: int, qs, ks, vs):  # [b, q, heads, D], token-major
            kv.write(i, slots, ks, vs)
            window = self.windows[i]
            keys, values = kv.read(i, key_len, index[window], starts[window])
            return self._attention(i, qs, keys, values, positions, masks[window], exact).reshape(b, q, -1)

        floors = None if sequence_lengths is None else sequence_lengths[:, None].expand_as(positions)
        x, features = self._layers(x, self._rope(x, positions, floors), attend, exact, capture)
        if logit_index is not None:
            x = x[torch.arange(b, device=x.device), logit_index][:, None]
        if greedy and self.screened is not None and not exact:
            return self.screened(x, resolved(offsets)), features
        return (per_token if exact else _call)(self.lm_head, x), features

    def forward_ragged(self, groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], kv: PagedKV,
                       capture: bool = True, prompts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
                       greedy: bool = False, offsets: list[torch.Tensor | None] | None = None,
                       prompt_sequences: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Rows verifying blocks of different widths in one forward. `groups` = [(cache rows [g], input_ids [g, w],
        positions [g, w])], one per width. The projections, MLPs and lm_head run once over every group's tokens
        packed together, so the cost follows the tokens verified, not rows x the widest block; attention runs per
        group over its rows' cache slots. A group of token trees (`engine/tree.py`) adds (slots [g, w], mask
        [g, 1, w, key_len]): its tokens' K/V go to those slots and attend as the mask says (context and ancestors),
        not causally by position. `prompts`: more groups of the same form, prompts prefilled in the same forward
        (rows joining a batch), whose logits are their last position's only. Returns (logits [g, w, V] (prompts:
        [g, 1, V]), features [g, w, F] or None) per group, then per prompt group. With `greedy` and a screened
        read-out, the token ids [g, w] of the groups' (not the prompts') argmax in place of their logits (of the
        logits plus each group's `offsets` [g, w, V], where any group has them: zeros for those without).
        `prompt_sequences`: per prompt group, the length of the sequence its positions belong to (`LongRope`;
        default: up to its last position; a resumed row's next token is pending)."""
        last_only = [False] * len(groups) + [True] * len(prompts)
        groups = list(groups) + list(prompts)
        sizes = [group[1].numel() for group in groups]
        ids = torch.cat([group[1].reshape(-1) for group in groups])[None]
        positions = torch.cat([group[2].reshape(-1) for group in groups])[None]
        x = self.embed(ids)
        spans = []  # per group: the pool slots it writes, the pages it reads, key length, masks by window
        for rows, _, pos, *tree in groups:
            if tree:  # a node's key sits at its scratch slot, at the node's position (needed by windows only)
                written, mask = tree
                keys_at = (torch.arange(mask.shape[-1], device=x.device).expand(len(pos), -1).scatter(1, written, pos)
                           if any(self.windows) else None)
            else:
                written = pos
                keys_at = torch.arange(int(pos.max()) + 1, device=x.device)[None]
                mask = (keys_at[:, None, :] <= pos[:, :, None])[:, None]
            key_len = mask.shape[-1]
            starts = self._window_starts(pos, kv, self.exact)
            index = {w: kv.page_index(key_len, rows, s, w) for w, s in starts.items()}
            spans.append((kv.slots(written, rows), index, key_len, starts, self._masks(mask, pos, keys_at, starts)))

        def attend(i: int, qs, ks, vs):  # [1, T, heads, D]
            out, window = [], self.windows[i]
            for (rows, _, pos, *_), (slots, index, key_len, starts, masks), q, k, v in zip(
                    groups, spans, qs[0].split(sizes), ks[0].split(sizes), vs[0].split(sizes)):
                g, w = pos.shape
                kv.write(i, slots, k.view(g, w, *k.shape[1:]), v.view(g, w, *v.shape[1:]))
                keys, values = kv.read(i, key_len, index[window], starts[window])
                out.append(self._attention(i, q.view(g, w, *q.shape[1:]), keys, values, pos,
                                           masks[window], self.exact).reshape(g * w, -1))
            return torch.cat(out)[None]

        floors = None  # LongRoPE: a prompt's positions take the frequency set of its whole length (`LongRope`)
        if self.long_rope is not None and prompts:
            blocks = len(groups) - len(prompts)
            floors = [torch.zeros_like(pos) for _, _, pos, *_ in groups[:blocks]]
            for (_, _, pos, *_), n in zip(groups[blocks:], prompt_sequences or [None] * len(prompts)):
                floors.append(torch.full_like(pos, n) if n is not None
                              else (pos.amax(-1, keepdim=True) + 1).expand_as(pos))
            floors = torch.cat([f.reshape(-1) for f in floors])[None]
        x, features = self._layers(x, self._rope(x, positions, floors), attend, self.exact, capture)
        hidden = [h.view(*group[2].shape, -1)[:, -1:] if last else h.view(*group[2].shape, -1)
                  for h, group, last in zip(x[0].split(sizes), groups, last_only)]
        read = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden]) if any(last_only) else x[0]
        counts = [h.shape[0] * h.shape[1] for h in hidden]
        if greedy and self.screened is not None:  # blocks: their argmax; prompts: their last logits, as without
            blocks = len(counts) - len(prompts)
            split = sum(counts[:blocks])
            offsets = resolved(offsets)
            if offsets is not None and any(o is not None for o in offsets):
                offsets = torch.cat([read.new_zeros(n, self.screened.vocab) if o is None else o.reshape(n, -1)
                                     for o, n in zip(offsets, counts)])
            else:
                offsets = None
            logits = list(self.screened(read[:split], offsets).split(counts[:blocks]))
            if prompts:
                logits += self.lm_head(read[split:][None])[0].split(counts[blocks:])
        else:
            logits = (per_token if self.exact else _call)(self.lm_head, read[None])[0].split(counts)
        features = features[0].split(sizes) if features is not None else [None] * len(groups)
        return [(lg.view(*h.shape[:2], *lg.shape[1:]), f.view(*group[2].shape, -1) if f is not None else None)
                for lg, f, h, group in zip(logits, features, hidden, groups)]

    def _attention(self, i: int, qs, keys, values, positions, mask, exact: bool) -> torch.Tensor:
        """Causal attention of queries [b, q, heads, D] over cached keys/values [b, k, kv_heads, D]; the output
        token-major [b, q, heads, D]."""
        attn = self.layers[i].self_attn
        qs, keys, values = qs.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        gqa = self.num_heads != self.num_kv_heads
        cap, sinks = getattr(attn, "attn_logit_softcapping", None), getattr(attn, "sinks", None)
        if exact:
            out = attend_each_query(qs, keys, values, positions, attn.scaling, gqa, self.windows[i], cap, sinks)
        elif cap or sinks is not None:
            out = eager_attention(qs, keys, values, mask, attn.scaling, cap, sinks)
        else:
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=attn.scaling,
                                                 enable_gqa=gqa)
        return out.transpose(1, 2)

    def _layers(self, x, rope: list, attend, exact: bool, capture: bool):
        """The decoder layers over token-major hidden states x [..., H] (`rope`: per layer cos/sin [..., 1, D],
        `_rope`); `attend` writes the layer's K/V and attends. Returns the final-normed hidden states and the tapped
        features (or None)."""
        project = per_token if exact else _call
        taps = self.target.layer_ids if capture else []
        captured = {}
        last = len(self.layers) - 1
        shape = x.shape[:-1]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            qs, ks, vs = self._qkv(i, h, project)
            qs = qs.view(*shape, self.num_heads, self.head_dim)
            ks = ks.view(*shape, self.num_kv_heads, self.head_dim)
            vs = vs.view(*shape, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                qs, ks = attn.q_norm(qs), attn.k_norm(ks)
            cos, sin = rope[i]
            qs, ks = rotated(qs, cos, sin), rotated(ks, cos, sin)
            out = project(attn.o_proj, attend(i, qs, ks, vs))
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2 / 3: norms after attention, around the MLP
                x = x + layer.post_attention_layernorm(out)
                x = x + layer.post_feedforward_layernorm(self._mlp(i, layer.pre_feedforward_layernorm(x), project))
            else:
                x = x + out
                x = x + self._mlp(i, layer.post_attention_layernorm(x), project)
            if i in taps and i != last:
                captured[i] = x
        x = self.norm(x)
        if last in taps:
            captured[last] = x  # transformers' hidden_states[L] is after the final norm
        return x, (torch.cat([captured[i] for i in taps], dim=-1) if taps else None)

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKV, lengths: torch.Tensor,
                capture: bool, exact_from: list[int] | None = None) -> tuple[torch.Tensor, list | None]:
        """The prompts (right-padded to one width): last-position logits [b, 1, V] and, with `capture`, each row's
        features [n_r, F] of its n_r = lengths[r] positions (views of the forwards' outputs, no padded copy). In exact
        mode each row's prompt runs alone as one ordinary block, so a row's prompt is computed the same way
        whatever the batch (and as transformers' own prefill computes it); the tokens after it go one row at a
        time through `forward`. A resumed row (preempted, recomputed) holds its prompt then the tokens it had
        decoded, from `exact_from[r]` on: in exact mode those go through the exact forward, as they did first."""
        # LongRoPE: the sequence each row's positions belong to; a resumed row's next token is pending
        sequences = lengths if exact_from is None else lengths + 1
        if not self.exact:
            return self._prefill_by_length(input_ids, positions, kv, lengths, capture, sequences)
        logits, features = [], []
        for r, n in enumerate(lengths.tolist()):
            p = n if exact_from is None else min(n, exact_from[r])
            row_logits, row_features = self.forward(input_ids[r:r + 1, :p], positions[r:r + 1, :p], kv.rows([r]),
                                                    logit_index=torch.tensor([p - 1], device=input_ids.device),
                                                    capture=capture, key_len=p, exact=False,
                                                    sequence_lengths=sequences[r:r + 1])
            if p < n:  # the decoded tokens, as verification computed them
                row_logits, decoded = self.forward(input_ids[r:r + 1, p:n], positions[r:r + 1, p:n], kv.rows([r]),
                                                   logit_index=torch.tensor([n - p - 1], device=input_ids.device),
                                                   capture=capture, key_len=n, exact=True,
                                                   sequence_lengths=sequences[r:r + 1])
                row_features = None if row_features is None else torch.cat([row_features, decoded], dim=1)
            logits.append(row_logits)
            if row_features is not None:
                features.append(row_features[0])
        return torch.cat(logits), (features if capture else None)

    def _prefill_by_length(self, input_ids, positions, kv: PagedKV, lengths: torch.Tensor, capture: bool,
                           sequences: torch.Tensor):
        """Prompts of similar lengths in one forward each (`length_groups`): one long prompt does not make every
        short one beside it compute, and hold the attention scores of, its length. `sequences`: the length of the
        sequence each row's positions belong to (`LongRope`)."""
        n = lengths.tolist()
        groups = length_groups(n)
        if len(groups) == 1:
            logits, features = self.forward(input_ids, positions, kv, logit_index=lengths - 1, capture=capture,
                                            key_len=input_ids.shape[1], sequence_lengths=sequences)
            return logits, None if features is None else [f[:length] for f, length in zip(features, n)]
        logits, features = None, [None] * len(n) if capture else None
        for idx in groups:
            rows = torch.tensor(idx, device=input_ids.device)
            width = int(lengths[rows].max())
            group_logits, group_features = self.forward(input_ids[rows, :width], positions[rows, :width],
                                                        kv.rows(idx), logit_index=lengths[rows] - 1,
                                                        capture=capture, key_len=width,
                                                        sequence_lengths=sequences[rows])
            if logits is None:
                logits = group_logits.new_empty((input_ids.shape[0], *group_logits.shape[1:]))
            logits[rows] = group_logits
            if capture:  # views: a row's pending features hold its group's output, at most twice the group's tokens
                for r, f in zip(idx, group_features):
                    features[r] = f[:n[r]]
        return logits, features

    def _qkv(self, i: int, h: torch.Tensor, project) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.layers[i].self_attn
        if self.packed_layers is None and not hasattr(attn, "qkv_proj"):
            return project(attn.q_proj, h), project(attn.k_proj, h), project(attn.v_proj, h)
        kv_width = self.num_kv_heads * self.head_dim
        qkv = project(attn.qkv_proj if self.packed_layers is None else self.packed_layers[i][0], h)
        return qkv.split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)

    def _mlp(self, i: int, h: torch.Tensor, project) -> torch.Tensor:
        mlp = self.layers[i].mlp
        if is_sparse(mlp):  # the block wants [batch, tokens, H]; exact mode routes each token alone
            if project is _call:
                return sparse_forward(mlp, h)
            return project(lambda row: sparse_forward(mlp, row[None])[0], h)
        if self.packed_layers is None:
            if project is _call:
                return mlp(h)
            projections, down = gate_up_linears(mlp), mlp.down_proj
        else:
            _, gate_up, down = self.packed_layers[i]
            projections = [gate_up]
        gate, up = (project(projections[0], h).chunk(2, dim=-1) if len(projections) == 1 else
                    [project(linear, h) for linear in projections])
        return project(down, activation(mlp)(gate) * up)


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Rows (indices into `lengths`) grouped for prefill, longest first: a row joins the group of the longer rows
    before it while padding every row to the group's longest stays within twice the group's real tokens."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    groups: list[list[int]] = []
    for r in order:
        if groups:
            group = groups[-1]
            if (len(group) + 1) * lengths[group[0]] <= 2 * (sum(lengths[i] for i in group) + lengths[r]):
                group.append(r)
                continue
        groups.append([r])
    return groups


def _call(linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x)


def per_token(linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` with each token row as its own one-row product: the result of a row does not depend on how
    many rows share the call (see `exact` in the module docstring)."""
    rows = x.reshape(-1, 1, x.shape[-1])
    # each row in its own fresh buffer: a view's memory alignment can change how a kernel splits its sums
    return torch.cat([linear(row.clone()) for row in rows]).reshape(*x.shape[:-1], -1)


def attend_each_query(qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                      scale: float, gqa: bool, window: int | None = None, cap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention [b, H, q, D] with each query alone over exactly the keys of its positions 0..p (p - window
    + 1..p in a sliding-window layer): the same call for a position whether it is decoded alone, verified in a
    block or prefilled."""
    out = torch.empty_like(qs)
    for r, row_positions in enumerate(positions.tolist()):
        for j, p in enumerate(row_positions):
            first = max(0, p - window + 1) if window else 0
            query = qs[r:r + 1, :, j:j + 1]
            key, value = keys[r:r + 1, :, first:p + 1], values[r:r + 1, :, first:p + 1]
            out[r:r + 1, :, j:j + 1] = (
                eager_attention(query, key, value, None, scale, cap, sinks) if cap or sinks is not None else
                F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=gqa))
    return out


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """transformers' logit soft-capping, in its order of operations: tanh(x / cap) * cap."""
    return torch.tanh(x / cap) * cap


class SoftCapped(torch.nn.Module):
    """A read-out followed by soft-capping of its logits (Gemma 2's `final_logit_softcapping`)."""

    def __init__(self, linear: torch.nn.Module, cap: float):
        super().__init__()
        self.linear, self.cap = linear, float(cap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.linear(x), self.cap)


def eager_attention(qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention [b, H, q, D] as transformers' eager attention computes it where SDPA cannot: Gemma 2's scores
    soft-capped before the mask (softmax in float32), gpt-oss's learned sink logit per head beside every row of
    scores (max subtracted, softmax in the scores' dtype, the sink's share dropped). keys / values [b, KV, k, D]."""
    groups = qs.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(qs, keys.transpose(2, 3)) * scale
    if cap:
        scores = soft_cap(scores, cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(qs.dtype), values)
    scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)], dim=-1)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(values.dtype), values)


def rotated(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on token-major heads [..., heads, D]: the first cos.shape[-1] dimensions rotate, the rest pass (partial
    rotary embeddings, as transformers' Phi-3 applies them)."""
    dims = cos.shape[-1]
    if dims == heads.shape[-1]:
        return heads * cos + rotate_half(heads) * sin
    turning = heads[..., :dims]
    return torch.cat([turning * cos + rotate_half(turning) * sin, heads[..., dims:]], dim=-1)
