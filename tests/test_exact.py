"""Exact mode (`SpecEngine(exact=True)`): a batch-invariant target forward, so speculative output is bit-identical
to plain decoding, whatever the precision, block size or batch.

Without it a 16-token verify and a one-token step sum their dot products in different orders (GEMM blocking
depends on the row count, attention kernels on the query count), so logits differ in the last bits and a near-tie
of the top two can flip a greedy token. The targets here are float32 / bfloat16 with hidden size 256, where this
CPU's MKL and attention kernels do round differently per row count.
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from flashdraft import SamplingParams, SpecEngine
from flashdraft.model.cpu_linear import native_bf16_cpu
from flashdraft.model.fast_target import FastTarget
from flashdraft.model.target import TargetModel
from tiny import OracleProposer, make_drafter

VOCAB = 512


def _target(dtype, moe: bool = False):
    """Qwen3, or with `moe` Qwen3-MoE (8 experts, 2 a token, transformers' default experts implementation)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=5,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if moe:
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                                                  **shape)).to(dtype).eval()
    return Qwen3ForCausalLM(Qwen3Config(**shape)).to(dtype).eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _block_then_steps(fast, prompt, block):
    """Logits of `block` after `prompt`: once as one block forward, once as one-token steps on a fresh cache."""
    out = []
    for chunks in ([block], [[t] for t in block]):
        kv = fast.new_cache(1, 128)
        fast.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], kv, key_len=len(prompt))
        pos, logits = len(prompt), []
        for chunk in chunks:
            positions = torch.arange(pos, pos + len(chunk))[None]
            logits.append(fast.forward(torch.tensor([chunk]), positions, kv, key_len=pos + len(chunk))[0])
            pos += len(chunk)
        out.append(torch.cat(logits, dim=1))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pack", [False, True], ids=["mkl", "packed"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@torch.inference_mode()
def test_exact_block_logits_equal_one_token_steps_bit_for_bit(dtype, pack, moe):
    if pack and dtype == torch.bfloat16 and not native_bf16_cpu():
        pytest.skip("this CPU's oneDNN has no bf16 path to pack for")
    target = TargetModel(_target(dtype, moe))
    target.set_layer_ids([0, 2])
    prompt, block = _prompts(1)[0], _prompts(1, seed=1)[0][:16]
    together, alone = _block_then_steps(FastTarget(target, pack_weights=pack, exact=True), prompt, block)
    assert torch.equal(together, alone)
    # the same model without exact mode: equal only up to rounding (on this CPU: not bit for bit for MKL fp32)
    together, alone = _block_then_steps(FastTarget(target, pack_weights=pack), prompt, block)
    torch.testing.assert_close(together.float(), alone.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_exact_rows_do_not_depend_on_the_batch(dtype):
    target = TargetModel(_target(dtype))
    fast = FastTarget(target, exact=True)
    prompts = _prompts(3, seed=2)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    batched, _ = fast.forward(ids, torch.arange(width)[None].expand(3, -1), fast.new_cache(3, 64),
                              logit_index=lengths - 1, capture=False, key_len=width)
    for r, p in enumerate(prompts):
        alone, _ = fast.forward(torch.tensor([p]), torch.arange(len(p))[None], fast.new_cache(1, 64),
                                logit_index=torch.tensor([len(p) - 1]), capture=False, key_len=len(p))
        assert torch.equal(batched[r], alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drafting", ["dflash", "oracle"])
def test_exact_speculative_output_is_plain_decoding_bit_for_bit(dtype, drafting):
    model = _target(dtype)
    prompts = _prompts(12, seed=3)
    params = SamplingParams(max_new_tokens=40)
    plain = SpecEngine(model, exact=True).generate(prompts, params)
    plain_alone = [SpecEngine(model, exact=True).generate([p], params)[0] for p in prompts[:2]]
    assert [r.token_ids for r in plain[:2]] == [r.token_ids for r in plain_alone]  # batch-invariant
    if drafting == "oracle":  # drafts that are mostly right: long accepted prefixes and every rejection point
        refs = [p + r.token_ids for p, r in zip(prompts, plain)]
        engine = SpecEngine(model, block_size=8, proposer=OracleProposer(refs, vocab=VOCAB, seed=1), exact=True)
    else:
        engine = SpecEngine(model, make_drafter(model, block_size=8, dtype=dtype), exact=True)
    spec = engine.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    if drafting == "oracle":
        assert sum(r.stats.num_accepted_tokens for r in spec) > 40  # the blocks really were verified together


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3", "gpt_oss"])
def test_exact_mode_attends_within_sliding_windows(arch):
    """Exact mode attends each query alone over its own keys: in a sliding-window layer only the window's (the tiny
    targets' windows are shorter than these contexts), as the target's own `generate` does."""
    from tiny import greedy_reference, make_target
    model = make_target(arch)
    prompts = [[(5 * i + 2) % 90 for i in range(n)] for n in (7, 45)]
    results = SpecEngine(model, make_drafter(model, block_size=8), exact=True).generate(
        prompts, SamplingParams(max_new_tokens=30))
    assert [r.token_ids for r in results] == [greedy_reference(model, p, 30) for p in prompts]


def test_exact_refuses_what_it_cannot_honour():
    from tiny import make_target
    with pytest.raises(ValueError, match="exact=True needs the fast target path"):
        SpecEngine(make_target("olmo2"), exact=True)
    with pytest.raises(ValueError, match="cannot be combined with compile"):
        SpecEngine(make_target("qwen3"), exact=True, compile=True)


def test_cli_exact_flag(tmp_path, capsys):
    import json

    from flashdraft.cli import main
    from tiny import save_text_pair

    save_text_pair(tmp_path)
    common = ["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "drafter"), "--prompt",
              "def add(a, b):", "--max-new-tokens", "24", "--device", "cpu"]
    assert main(common + ["--exact", "--compare", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["baseline"]["identical_output"] is True and report["identical_to_target_generate"] is True
    assert main(common + ["--exact", "--compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot be combined with compile" in err
