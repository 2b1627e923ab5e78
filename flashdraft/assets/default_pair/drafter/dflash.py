"""DFlash drafter, self-contained: torch + transformers only (4.57 or 5.x), for the remote-code loading line

    from transformers import AutoModel
    drafter = AutoModel.from_pretrained(path, trust_remote_code=True, dtype="auto")
    out = drafter.spec_generate(target=target, input_ids=ids, max_new_tokens=256, stop_token_ids=[eos])

`flashdraft`'s `DFlashDraftModel.save_pretrained` copies this file beside the weights as `dflash.py` (config.json
`auto_map: {"AutoModel": "dflash.DFlashDraftModel"}`). It imports nothing from flashdraft. It implements what the
exported config.json can state (docs/checkpoints.md): Qwen3-style layers with context K/V injection; per layer a
sliding window and a causal block by vLLM's rules (`is_causal`, else `dflash_config.causal`, else "the layer
slides"); attention sinks; NeoX or interleaved RoPE (`is_neox_style`); `input_embedding_scale`, `logit_scale`,
`output_multiplier`, `final_logit_softcapping`; the drafter's own `embed_tokens` / `lm_head` / separate mask
embedding where `dflash_config.extra_weights` lists them; a reduced draft vocabulary (`draft_vocab_size` + `d2t`).
The rope base is read by transformers' own `Qwen3RotaryEmbedding`: 4.x from `rope_theta` / `rope_scaling`, 5.x
from `rope_parameters`; the export writes both.

Generation (`spec_generate`, batch 1): greedy verification, or at temperature > 0 rejection sampling of the
drafter's argmax proposals (accept draft x with probability p(x), else sample p without x), so the output follows
the target's distribution. The target runs with transformers' DynamicCache (cropped after each cycle); the
drafter keeps its own context K/V.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

SLIDING = "sliding_attention"


def _dflash(config, name, default=None):
    nested = getattr(config, "dflash_config", None) or {}
    if nested.get(name) is not None:
        return nested[name]
    value = getattr(config, name, None)
    return default if value is None else value


def _layer_attention(config, i):
    nested = getattr(config, "dflash_config", None) or {}
    layer_types = getattr(config, "layer_types", None) or []
    typed = bool(layer_types) and layer_types[i] == SLIDING
    sliding = typed
    if nested.get("use_swa") and SLIDING not in layer_types:
        sliding = True
    window = None
    if sliding:
        window = nested.get("swa_window_size") or getattr(config, "sliding_window", None)
        if not window:
            raise ValueError(f"layer {i} slides but the config gives no window (swa_window_size / sliding_window)")
    causal = getattr(config, "is_causal", None)
    if causal is None:
        causal = nested.get("causal")
    if causal is None:
        causal = typed  # use_swa layers slide but stay non-causal unless typed sliding (vLLM)
    return (int(window) if window else None), bool(causal)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rope(x, cos, sin, interleaved):
    """x [b, h, n, d]; cos/sin [b, n, d] in transformers' layout (the d/2 frequencies twice)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if not interleaved:
        return x * cos + _rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    return x * cos + _rotate_every_two(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.sliding_window, self.is_causal = _layer_attention(config, layer_idx)
        self.interleaved = not bool(getattr(config, "is_neox_style", True))
        sinks = bool(_dflash(config, "attention_sink_bias", getattr(config, "add_swa_attention_sink_bias", False)))
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None

    def kv(self, x, cos, sin):
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin, self.interleaved), v

    def forward(self, x, ctx_k, ctx_v, cos, sin, q_pos, ctx_pos):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos, sin, self.interleaved)
        k_blk, v_blk = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k_blk], dim=2), torch.cat([ctx_v, v_blk], dim=2)
        kp, qp = torch.cat([ctx_pos, q_pos], dim=-1)[:, None, :], q_pos[:, :, None]
        mask = torch.ones(b, n, kp.shape[-1], dtype=torch.bool, device=x.device)
        if self.is_causal:
            mask &= kp <= qp
        if self.sliding_window is not None:
            mask &= (qp - kp) < self.sliding_window
            if not self.is_causal:
                mask &= (kp - qp) < self.sliding_window
        mask = mask[:, None]
        if self.num_heads != self.num_kv_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.attention_sink_bias is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        else:  # one extra per-head logit in the softmax denominator that attends to nothing
            scores = (q @ k.transpose(-1, -2) * self.scaling).masked_fill(~mask, float("-inf"))
            sink = self.attention_sink_bias.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, n, 1)
            out = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        ids = _dflash(config, "target_layer_ids")
        if not ids:
            raise ValueError("the drafter config gives no dflash_config.target_layer_ids")
        self.target_layer_ids = [int(i) for i in ids]
        self.mask_token_id = int(_dflash(config, "mask_token_id"))
        self.block_size = int(_dflash(config, "block_size", 16))
        H = config.hidden_size
        target_hidden = int(getattr(config, "target_hidden_size", None) or H)
        extra = set(_dflash(config, "extra_weights", []) or [])
        vocab = int(config.vocab_size)
        draft_vocab = int(getattr(config, "draft_vocab_size", None) or vocab)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.embed_tokens = nn.Embedding(vocab, H) if "embed_tokens" in extra else None
        self.lm_head = nn.Linear(H, draft_vocab, bias=False) if "lm_head" in extra else None
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False) \
            if draft_vocab != vocab else None
        self.mask_embedding = nn.Parameter(torch.zeros(H)) if "mask_embedding" in extra else None
        self.post_init()

    # ---- one draft block ----------------------------------------------------------------------------------------

    def _cos_sin(self, x, positions):
        return self.rotary_emb(x, positions)

    def write_context(self, cache, target_hidden, positions):
        """Project target features [1, c, n_taps * H_target] at `positions` [1, c] into every layer's context K/V."""
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self._cos_sin(ctx, positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            if cache["k"][i] is None:
                cache["k"][i], cache["v"][i] = k, v
            else:
                cache["k"][i] = torch.cat([cache["k"][i], k], dim=2)
                cache["v"][i] = torch.cat([cache["v"][i], v], dim=2)
        cache["pos"] = positions if cache["pos"] is None else torch.cat([cache["pos"], positions], dim=1)

    def embed(self, input_ids, target):
        weight = self.embed_tokens.weight if self.embed_tokens is not None else target.get_input_embeddings().weight
        emb = F.embedding(input_ids, weight).to(self.fc.weight.dtype)
        scale = float(_dflash(self.config, "input_embedding_scale", 1.0))
        if scale != 1.0:
            emb = emb * scale
        if self.mask_embedding is not None:
            emb = torch.where((input_ids == self.mask_token_id)[..., None], self.mask_embedding.to(emb.dtype), emb)
        return emb

    def forward(self, noise_embedding, position_ids, cache):
        x = noise_embedding
        cos, sin = self._cos_sin(x, position_ids)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, cache["k"][i], cache["v"][i], cos, sin, position_ids, cache["pos"])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def compute_logits(self, hidden, target):
        head = self.lm_head if self.lm_head is not None else target.get_output_embeddings()
        logits = head(hidden.to(head.weight.dtype))
        scale = float(getattr(self.config, "logit_scale", None) or 1.0) * float(
            _dflash(self.config, "output_multiplier", 1.0))
        if scale != 1.0:
            logits = logits * scale
        cap = _dflash(self.config, "final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        if self.d2t is not None:
            full = logits.new_full((*logits.shape[:-1], int(self.config.vocab_size)), float("-inf"))
            full[..., torch.arange(self.d2t.shape[0], device=logits.device) + self.d2t] = logits
            logits = full
        return logits

    # ---- speculative generation (batch 1) -----------------------------------------------------------------------

    @staticmethod
    def _features(hidden_states, layer_ids):
        return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids, max_new_tokens, stop_token_ids=None, temperature=0.0,
                      mask_token_id=None, return_stats=False):
        """[1, prompt + generated] token ids; with `return_stats`, a namespace with `output_ids` and
        `acceptance_lengths` (tokens committed per draft cycle, bonus included)."""
        self.eval()
        if mask_token_id is not None and int(mask_token_id) != self.mask_token_id:
            raise ValueError(f"mask_token_id {mask_token_id} differs from the drafter's {self.mask_token_id}")
        dev, B = input_ids.device, self.block_size
        stop = set(int(t) for t in (stop_token_ids or []))
        prompt_len = input_ids.shape[1]
        tcache = DynamicCache()
        out = target(input_ids, position_ids=torch.arange(prompt_len, device=dev)[None], past_key_values=tcache,
                     use_cache=True, output_hidden_states=True)
        cache = {"k": [None] * len(self.layers), "v": [None] * len(self.layers), "pos": None}
        self.write_context(cache, self._features(out.hidden_states, self.target_layer_ids),
                           torch.arange(prompt_len, device=dev)[None])
        generated = [self._pick(out.logits[0, -1], temperature)]
        acceptance = []
        start = prompt_len  # position of the last committed token (not yet in the target's cache)
        while len(generated) < max_new_tokens and generated[-1] not in stop:
            block = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=dev)
            block[0, 0] = generated[-1]
            positions = torch.arange(start, start + B, device=dev)[None]
            hidden = self(self.embed(block, target), positions, cache)
            draft_logits = self.compute_logits(hidden[:, 1:], target)
            block[0, 1:] = draft_logits[0].argmax(dim=-1)
            out = target(block, position_ids=positions, past_key_values=tcache, use_cache=True,
                         output_hidden_states=True)
            logits = out.logits[0]
            drafts = block[0, 1:].tolist()
            accepted = 0
            for i, d in enumerate(drafts):
                if temperature <= 0:
                    ok = int(logits[i].argmax()) == d
                else:
                    p = torch.softmax(logits[i].float() / temperature, dim=-1)
                    ok = bool(torch.rand((), device=p.device) < p[d])
                    if not ok:
                        p[d] = 0
                        nxt = int(torch.multinomial(p / p.sum(), 1))
                if not ok:
                    break
                accepted += 1
            if accepted == len(drafts) or temperature <= 0:
                nxt = self._pick(logits[accepted], temperature)
            new = drafts[:accepted] + [nxt]
            keep = new[: max_new_tokens - len(generated)]
            for j, t in enumerate(keep):
                if t in stop:
                    keep = keep[: j + 1]
                    break
            acceptance.append(len(keep))
            generated += keep
            self.write_context(cache, self._features(out.hidden_states, self.target_layer_ids)[:, : accepted + 1],
                               positions[:, : accepted + 1])
            start += accepted + 1
            remove = tcache.get_seq_length() - start
            if remove > 0:  # a negative count means "drop that many" in 4.57 and 5.x alike
                tcache.crop(-remove)
        ids = torch.cat([input_ids, torch.tensor([generated], dtype=input_ids.dtype, device=dev)], dim=1)
        if return_stats:
            return SimpleNamespace(output_ids=ids, acceptance_lengths=acceptance)
        return ids

    @staticmethod
    def _pick(logits, temperature):
        if temperature <= 0:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1))
