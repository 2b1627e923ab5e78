"""Tiny randomly initialised targets and drafters, built from configs (no downloads), for CPU tests.

`WINDOWED`: the architectures here with sliding-window layers shorter than the tests' contexts (the generic path is
exact for them at batch 1 only, `engine/generate.py`).

Models run in float64 so that a block verify and a one-token step round identically enough for argmax: the
losslessness tests then measure the engine, not floating-point ties.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import pytest

from flashdraft import DFlashDraftModel, make_draft_config
from flashdraft.engine import NoRowState
from flashdraft.model.cpu_linear import native_bf16_cpu

# tests of oneDNN's packed bf16 weights (and of the bf16 drafter a CPU gets by default) run where oneDNN has them
needs_native_bf16 = pytest.mark.skipif(
    not native_bf16_cpu(), reason="this CPU's oneDNN has no bf16 path (needs AVX512BW/VL/DQ, AVX-NE-CONVERT or AMX)")

VOCAB = 96
MASK_ID = VOCAB - 1
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
               pad_token_id=None, tie_word_embeddings=False)
# mixture-of-experts targets: 4 experts, 2 per token, one dense layer among sparse ones where the family allows it;
# eager experts (transformers' default grouped_mm has no float64 kernel)
_EXPERTS = dict(num_experts_per_tok=2, experts_implementation="eager")

ARCHITECTURES = {
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(head_dim=8, **_COMMON)),
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_COMMON)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(sliding_window=None, **_COMMON)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**_COMMON)),
    # fused q/k/v and gate/up, half the head dimensions rotary, a sliding window shorter than the tests' contexts
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(partial_rotary_factor=0.5, sliding_window=24, **_COMMON)),
    "gemma": (GemmaForCausalLM, lambda: GemmaConfig(head_dim=8, **_COMMON)),
    # soft-capped attention scores and logits, sliding and full layers, norms around attention and MLP
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(head_dim=8, sliding_window=16, query_pre_attn_scalar=8,
                                                       attn_logit_softcapping=0.3, final_logit_softcapping=3.0,
                                                       **_COMMON)),
    # sliding and full layers with their own rotary frequencies, norms around attention and MLP
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        head_dim=8, sliding_window=16, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"], **_COMMON)),
    "mistral_window": (MistralForCausalLM, lambda: MistralConfig(sliding_window=20, **_COMMON)),
    # no fast path (norms after attention and MLP only, q/k norms over all heads): the generic path's representative
    "olmo2": (Olmo2ForCausalLM, lambda: Olmo2Config(**_COMMON)),
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(head_dim=8, num_experts=4, moe_intermediate_size=32,
                                                               mlp_only_layers=[1], **_EXPERTS, **_COMMON)),
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(num_local_experts=4, sliding_window=None, **_EXPERTS,
                                                          **_COMMON)),
    # learned attention sinks, q/k/v/o biases, half-size rotary tables, alternating windows, its own experts block
    "gpt_oss": (GptOssForCausalLM, lambda: GptOssConfig(
        head_dim=8, num_local_experts=4, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"], **_EXPERTS, **_COMMON)),
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32,
                                                              shared_expert_intermediate_size=48, mlp_only_layers=[2],
                                                              **_EXPERTS, **_COMMON)),
}

WINDOWED = ("phi3", "gemma2", "gemma3", "mistral_window", "gpt_oss")


def make_target(arch: str = "qwen3", seed: int = 0, dtype=torch.float64):
    cls, config_fn = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = cls(config_fn())
    # sharpen the random logits a little so greedy continuations are not dominated by near-ties
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.to(dtype).eval()


def make_drafter(target, block_size: int = 4, num_layers: int = 2, seed: int = 1, dtype=torch.float64, **kwargs):
    torch.manual_seed(seed)
    config = make_draft_config(target.config, num_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID,
                               **kwargs)
    return DFlashDraftModel(config).to(dtype).eval()


def greedy_reference(target, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """The target's own greedy continuation (transformers generate), stopping after `eos` if given."""
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt):].tolist()


class OracleProposer:
    """A test drafting method that knows the target's greedy continuation and corrupts it at random.

    It drives the engine through every acceptance length (full blocks, partial blocks, immediate rejection)
    across the rows of a batch, which a random drafter never does. references[request_id] = prompt + continuation.
    """

    needs_features = False
    needs_histories = True  # it reads each row's committed tokens and request id

    def __init__(self, references, vocab: int = VOCAB, corrupt: float = 0.4, seed: int = 0):
        self.references = references
        self.vocab = vocab
        self.corrupt = corrupt
        self.rng = torch.Generator().manual_seed(seed)

    def new_batch_state(self, buckets=None, page_size=None, max_pages=None):
        return NoRowState()

    def propose(self, state, inp, block_size):
        k = block_size - 1
        drafts = torch.randint(0, self.vocab, (len(inp.histories), k), generator=self.rng)
        for row, (req, history) in enumerate(zip(inp.request_ids, inp.histories)):
            ref = self.references[req]
            if ref[: len(history)] == history:
                truth = ref[len(history): len(history) + k]
                drafts[row, : len(truth)] = torch.tensor(truth, dtype=torch.long)
                if torch.rand(1, generator=self.rng).item() < self.corrupt:
                    j = int(torch.randint(0, k, (1,), generator=self.rng))
                    shift = 1 + int(torch.randint(0, self.vocab - 1, (1,), generator=self.rng))
                    drafts[row, j] = (drafts[row, j] + shift) % self.vocab
        return drafts.to(inp.bonus.device), None


def engine_with(proposer: str, target, prompts, expected, fast_path=None, tokenizer=None, seed: int = 0):
    """The engine a parametrized losslessness test runs: "oracle" (the expected continuations as drafts, half the
    blocks corrupted: every acceptance length, block 8, fixed policy), "dflash" (a random DFlash drafter, block 8) or
    "none" (plain decoding)."""
    from flashdraft import SpecEngine

    if proposer == "oracle":
        oracle = OracleProposer([p + e for p, e in zip(prompts, expected)], corrupt=0.5, seed=seed,
                                vocab=len(tokenizer) if tokenizer is not None else VOCAB)
        return SpecEngine(target, None, tokenizer, block_size=8, fast_path=fast_path, draft_policy="fixed",
                          proposer=oracle)
    drafter = make_drafter(target, block_size=8) if proposer == "dflash" else None
    return SpecEngine(target, drafter, tokenizer, fast_path=fast_path)


TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "flashdraft" / "assets" / "default_pair" / "target"


def load_tokenizer():
    """The project's own code tokenizer (8192 tokens, `<|mask|>` = id 1), shipped with the default pair."""
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def save_text_pair(root: Path, block_size: int = 8, draft_layers: int = 1, max_positions: int = 256,
                   lm_head_scale: float = 1.0, seed: int = 0):
    """A tiny random Qwen3 target saved with the project's tokenizer under root/target, and a DFlash drafter
    for it under root/drafter (float32, as users' checkpoints are). Returns (tokenizer, target config)."""
    tok = load_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    target = Qwen3ForCausalLM(cfg)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            target.lm_head.weight.mul_(lm_head_scale)
    target.save_pretrained(root / "target")
    for f in TOKENIZER_DIR.glob("tokenizer*.json"):
        shutil.copy(f, root / "target" / f.name)
    torch.manual_seed(seed + 1)
    drafter = DFlashDraftModel(make_draft_config(cfg, num_layers=draft_layers, block_size=block_size,
                                                 mask_token_id=tok.mask_token_id))
    drafter.save_pretrained(root / "drafter")
    return tok, cfg


def cache_row(kv, row: int, n: int) -> list:
    """Every layer's keys and values of positions [0, n) of one row of a paged cache (`slots.PagedKV`)."""
    import torch

    if not n:
        return []
    rows = kv.gather_rows(torch.tensor([row]), n)
    return [t[0] for layer in zip(rows.keys, rows.values) for t in layer]


def finished(events) -> dict:
    """The token ids of the requests that finished among stream events, by request index."""
    return {ev.index: ev.result.token_ids for ev in events if ev.finished}


def drain(engine, batch) -> dict:
    """Step `batch` until every row is done; the token ids of the requests that finished meanwhile (`finished`)."""
    results = {}
    while batch.rows:
        results.update(finished(engine.step(batch)))
    return results
