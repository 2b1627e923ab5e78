"""The engine's attention kernels: cuDNN's SDPA backend left out of the engine's calls on CUDA unless asked for
(`engine/kernels.py`), scoped to those calls.

On CPU the scope is a no-op, so the wiring is tested by giving a CPU engine the CUDA scope: torch's CPU attention
ignores the cuDNN flag, and every attention call records whether the flag was off when it ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashdraft.engine import EngineConfig, SamplingParams, SpecEngine
from flashdraft.engine.kernels import attention_scope
from tiny import greedy_reference, make_drafter, make_target

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30, 12, 4, 19, 22]]


def test_the_scope_leaves_cudnn_out_on_cuda_and_gives_the_process_its_setting_back():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        with attention_scope(torch.device("cuda"), cudnn=False)():
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        for device, cudnn in ((torch.device("cpu"), False), (torch.device("cuda"), True)):
            with attention_scope(device, cudnn)():
                assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.fixture
def cudnn_seen(monkeypatch):
    """Whether cuDNN's backend was allowed at each attention call."""
    seen: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
def test_every_engine_entry_point_runs_its_attention_in_the_scope(cudnn_seen, fast_path):
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target), fast_path=fast_path)
    engine._attention_scope = attention_scope(torch.device("cuda"), cudnn=False)
    params = SamplingParams(max_new_tokens=12)
    engine.warmup(2)
    outputs = {i: [] for i in range(3)}
    batch = engine.open_batch()
    for e in engine.add(batch, PROMPTS[:1], params, request_ids=[0]):
        outputs[e.index] += e.token_ids
    for prompts, ids in ((PROMPTS[1:], [1]), ([PROMPTS[0]], [2])):  # joining requests: riding or prefilled
        for e in engine.step(batch, prompts, params, request_ids=ids):
            outputs[e.index] += e.token_ids
    preempted = engine.preempt(batch, 1)
    engine.resume(batch, [preempted])
    while batch.rows:
        for e in engine.step(batch):
            outputs[e.index] += e.token_ids
    assert cudnn_seen and not any(cudnn_seen), f"{sum(cudnn_seen)} of {len(cudnn_seen)} calls allowed cuDNN"
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's own setting, after the engine's calls
    for i, prompt in zip(outputs, PROMPTS + PROMPTS[:1]):
        assert outputs[i] == greedy_reference(target, prompt, 12)


def test_asking_for_cudnn_leaves_the_calls_as_the_process_set_them(cudnn_seen):
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target), cudnn_attention=True)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=6))
    assert cudnn_seen and all(cudnn_seen)


def test_the_flag_reaches_the_engine_and_is_checked():
    from flashdraft.args import engine_config
    from flashdraft.cli import build_parser

    assert engine_config(build_parser().parse_args(["serve", "--cudnn-attention"])).cudnn_attention
    assert not engine_config(build_parser().parse_args(["bench"])).cudnn_attention
    with pytest.raises(ValueError, match="cudnn_attention must be True or False"):
        EngineConfig(cudnn_attention="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_without_cudnn_the_output_is_the_targets_own(cudnn_seen, dtype):
    """bf16 on CUDA is where torch picks cuDNN's backend; greedy output against the target's own `generate`
    (bf16: a near-tie between the two paths' roundings could flip a token; these prompts have none)."""
    target = make_target("qwen3", dtype=dtype).cuda()
    engine = SpecEngine(target, make_drafter(target, dtype=dtype).cuda())
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16))
    assert cudnn_seen and not any(cudnn_seen)
    for prompt, result in zip(PROMPTS, results):
        ids = torch.tensor([prompt], device="cuda")
        expected = target.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0,
                                   attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
        assert result.token_ids == expected
