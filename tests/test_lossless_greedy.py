"""Greedy losslessness: the engine's output equals the target's own greedy decoding, token for token.

200 randomized cases over 14 architectures (4 of them mixtures of experts, 5 with sliding-window layers shorter than
the contexts), block sizes {2, 4, 8, 16}, batch sizes {1, 3}, prompt lengths 1..64, with and without an EOS stop id,
each with either the DFlash drafter or an oracle drafter that makes the engine accept full, partial and empty blocks,
each through both target paths (the lean paged-cache fast path where the architecture has one, and the generic
transformers path; with sliding windows the generic path at batch 1 only, its documented limit). Every other case
runs again in float32 on the fast path with its projections through oneDNN on packed weights (the CPU default). Each
row is compared with `target.generate(do_sample=False)` on that row alone.
"""

import copy
import random

import pytest

from flashdraft import SamplingParams, SpecEngine
from tiny import WINDOWED, ARCHITECTURES, VOCAB, OracleProposer, greedy_reference, make_drafter, make_target

NUM_CASES = 200
FAST_ARCHS = ("qwen3", "llama", "mistral", "qwen2", "phi3", "gemma", "gemma2", "gemma3", "mistral_window", "gpt_oss",
              "qwen3_moe", "mixtral", "qwen2_moe")
_targets: dict = {}
_drafters: dict = {}


def _target(arch):
    if arch not in _targets:
        _targets[arch] = make_target(arch)
    return _targets[arch]


def _drafter(arch, block_size):
    if (arch, block_size) not in _drafters:
        _drafters[arch, block_size] = make_drafter(_target(arch), block_size=block_size)
    return _drafters[arch, block_size]


def _case(i):
    rng = random.Random(1000 + i)
    arch = list(ARCHITECTURES)[i % len(ARCHITECTURES)]
    block_size = [2, 4, 8, 16][(i // len(ARCHITECTURES)) % 4]
    batch = [1, 3][(i // 24) % 2]
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 64))] for _ in range(batch)]
    return arch, block_size, prompts, rng.randint(1, 40), rng.random() < 0.6, rng.random() < 0.5, rng


@pytest.mark.parametrize("i", range(NUM_CASES))
def test_greedy_equals_target(i):
    arch, block_size, prompts, max_new, use_eos, use_oracle, rng = _case(i)
    target = _target(arch)
    free_runs = [greedy_reference(target, p, max_new) for p in prompts]
    eos = None
    if use_eos:  # a token the target really produces, so that stopping is exercised
        run = free_runs[rng.randrange(len(prompts))]
        eos = run[rng.randrange(len(run))]
    expected = [greedy_reference(target, p, max_new, eos) if eos is not None else r for p, r in zip(prompts, free_runs)]
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=() if eos is None else (eos,))
    for fast_path in (None, False):  # the fast path where the architecture has one, and the generic path
        if fast_path is False and arch in WINDOWED and len(prompts) > 1:
            continue  # the generic path counts a padded batch's holes against the window (engine/generate.py)
        if use_oracle:
            proposer = OracleProposer([p + e for p, e in zip(prompts, expected)], seed=i)
            engine = SpecEngine(target, block_size=block_size, proposer=proposer, fast_path=fast_path)
        else:
            engine = SpecEngine(target, _drafter(arch, block_size), fast_path=fast_path)
        assert (engine.fast is not None) == (fast_path is None and arch in FAST_ARCHS)
        results = engine.generate(prompts, params)
        for row, (res, exp) in enumerate(zip(results, expected)):
            assert res.token_ids == exp, (
                f"case {i} ({arch}, block {block_size}, batch {len(prompts)}, row {row}, eos {eos}, oracle "
                f"{use_oracle}, fast path {engine.fast is not None}): engine {res.token_ids} != target {exp}"
            )
            assert res.finish_reason == ("stop" if eos is not None and exp and exp[-1] == eos else "length")
            s = res.stats  # every cycle commits its tokens: drafting cycles, one-token steps, lookup steps
            assert sum(s.acceptance_lengths) + s.plain_steps + s.lookup_steps + s.lookup_accepted >= len(exp) - 1


def test_oracle_cases_cover_every_acceptance_length():
    """The randomized suite must really exercise long acceptances, not only rejections."""
    target = _target("qwen3")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    expected = [greedy_reference(target, p, 40) for p in prompts]
    proposer = OracleProposer([p + e for p, e in zip(prompts, expected)], corrupt=0.5, seed=3)
    results = SpecEngine(target, block_size=8, proposer=proposer).generate(prompts, SamplingParams(max_new_tokens=40))
    lengths = {a for r in results for a in r.stats.acceptance_lengths}
    assert 8 in lengths and len(lengths) >= 4, lengths
    assert [r.token_ids for r in results] == expected


_targets32: dict = {}


@pytest.mark.parametrize("i", [i for i in range(0, NUM_CASES, 2) if _case(i)[0] in FAST_ARCHS])
def test_greedy_equals_target_fp32_packed(i):
    """The same cases in float32 on the fast path with projections through oneDNN on packed weights (what a CPU
    user gets by default), against transformers' own float32 greedy decoding."""
    arch, block_size, prompts, max_new, _, use_oracle, _ = _case(i)
    if arch not in _targets32:
        _targets32[arch] = copy.deepcopy(_target(arch)).float()
    target = _targets32[arch]
    expected = [greedy_reference(target, p, max_new) for p in prompts]
    if use_oracle:
        engine = SpecEngine(target, block_size=block_size, pack_weights=True,
                            proposer=OracleProposer([p + e for p, e in zip(prompts, expected)], seed=i))
    else:
        engine = SpecEngine(target, copy.deepcopy(_drafter(arch, block_size)).float(), pack_weights=True)
    assert engine.fast is not None and engine.fast.packed_layers is not None
    for row, (res, exp) in enumerate(zip(engine.generate(prompts, SamplingParams(max_new_tokens=max_new)), expected)):
        assert res.token_ids == exp, f"case {i} ({arch}, block {block_size}, row {row}): {res.token_ids} != {exp}"


def test_fast_path_refuses_what_it_does_not_reproduce():
    """Where the lean forward would differ from transformers' the engine keeps the generic path, and says why:
    `dynamic` rope (rescaled by the largest position seen), families it does not know. LongRoPE runs fast
    (tests/test_longrope.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    from flashdraft.model.fast_target import fast_path_unsupported
    from tiny import _COMMON

    longrope = Phi3ForCausalLM(Phi3Config(**{**_COMMON, "max_position_embeddings": 1024},
                                          original_max_position_embeddings=256,
                                          rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                           "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}))
    dynamic = LlamaForCausalLM(LlamaConfig(**_COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                        "factor": 2.0}))
    assert fast_path_unsupported(longrope) is None
    assert fast_path_unsupported(dynamic) == "rope type 'dynamic'"
    assert fast_path_unsupported(make_target("olmo2")).startswith("model_type 'olmo2' is not one of")
    assert SpecEngine(make_target("olmo2")).fast is None
    for arch in ("phi3", "gemma", "gemma3", "mistral_window"):
        assert fast_path_unsupported(make_target(arch)) is None


@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_fast_path_logits_are_transformers_logits(arch):
    """The lean forward's logits at every position of a prompt, and of a block after it, are transformers' own
    (float64, up to rounding): soft-capped logits and scores, windows, partial and per-layer RoPE included."""
    import torch

    from flashdraft.model.fast_target import FastTarget
    from flashdraft.model.target import TargetModel

    model = make_target(arch)
    ids = torch.tensor([[(11 * i + 5) % (VOCAB - 1) for i in range(60)]])
    expected = model(input_ids=ids).logits
    fast = FastTarget(TargetModel(model), pack_weights=False)
    kv = fast.new_cache(1, 64)
    with torch.inference_mode():
        head, _ = fast.forward(ids[:, :44], torch.arange(44)[None], kv, capture=False, key_len=44)
        block, _ = fast.forward(ids[:, 44:], torch.arange(44, 60)[None], kv, capture=False, key_len=60)
    torch.testing.assert_close(torch.cat([head, block], dim=1), expected, rtol=1e-9, atol=1e-9)


def test_multimodal_gemma3_runs_its_language_model_on_the_fast_path():
    """Gemma 3 as users load it (`Gemma3ForConditionalGeneration`): text prompts reach only its language model, which
    the fast path runs (windows, per-layer RoPE); a batch of two equals the model's own `generate`. M-RoPE text
    configs (Qwen2-VL's 3-D positions) stay on the generic path."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from flashdraft.model.fast_target import fast_path_unsupported

    text = ARCHITECTURES["gemma3"][1]()
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                        image_token_index=90, boi_token_index=91, eoi_token_index=92))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model = model.double().eval()
    prompts = [[(7 * i + 3) % 89 for i in range(n)] for n in (5, 40)]
    engine = SpecEngine(model, make_drafter(model, block_size=8))
    assert engine.fast is not None
    results = engine.generate(prompts, SamplingParams(max_new_tokens=30))
    assert [r.token_ids for r in results] == [greedy_reference(model, p, 30) for p in prompts]
    qwen = make_target("qwen3")
    qwen.config.rope_parameters = {**qwen.config.rope_parameters, "mrope_section": [2, 1, 1]}
    assert fast_path_unsupported(qwen) == "M-RoPE (3-D positions)"
