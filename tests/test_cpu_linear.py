"""oneDNN projections on packed weights (`flashdraft/model/cpu_linear.py`): same results as `F.linear`, eager and
compiled, and the engine's choice of when to pack."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashdraft import SpecEngine
from flashdraft.model import cpu_linear
from flashdraft.model.cpu_linear import PackedLinear, can_pack, pack_by_default, packed_concat, packed_linear
from tiny import make_drafter, make_target, needs_native_bf16

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2,
                                                                          marks=needs_native_bf16)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, tol, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 200, bias=bias).to(dtype)
    twin = packed_linear(linear)
    assert isinstance(twin, PackedLinear) and twin.weight is linear.weight and twin.bias is linear.bias
    for shape in [(1, 64), (16, 64), (3, 16, 64), (2, 5, 64)]:
        x = torch.randn(shape, dtype=dtype)
        torch.testing.assert_close(twin(x), F.linear(x, linear.weight, linear.bias), atol=tol, rtol=tol)
    x = torch.randn(3, 16, 64, dtype=dtype)[:, ::2]  # a strided view
    torch.testing.assert_close(twin(x), F.linear(x, linear.weight, linear.bias), atol=tol, rtol=tol)


def test_packed_concat_computes_the_linears_side_by_side():
    torch.manual_seed(0)
    a, b = nn.Linear(32, 48), nn.Linear(32, 80)
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(packed_concat([a, b])(x), torch.cat([a(x), b(x)], dim=-1), atol=1e-5, rtol=1e-5)


def test_packed_linear_compiles_to_the_same_result():
    torch.manual_seed(0)
    twin = packed_linear(nn.Linear(64, 512, bias=False))
    step = torch.compile(lambda x: twin(x).argmax(-1), fullgraph=True)
    x = torch.randn(2, 16, 64)
    assert torch.equal(step(x), twin(x).argmax(-1))


def test_what_is_not_packed_comes_back_unchanged():
    half = nn.Linear(8, 8).half()
    assert packed_linear(half) is half
    assert packed_linear(nn.ReLU()).__class__ is nn.ReLU
    assert not can_pack(torch.zeros(2, 2, dtype=torch.float64))
    assert not can_pack(torch.zeros(2, 2, device="meta"))


def test_auto_packing_stays_within_its_budget(monkeypatch):
    weights = [torch.zeros(256, 256), torch.zeros(256, 256, dtype=torch.bfloat16)]
    monkeypatch.setattr(cpu_linear, "packing_pays", lambda weights, rows=(1, 16): True)
    monkeypatch.setattr(cpu_linear, "native_bf16_cpu", lambda: True)  # nothing is packed here: any CPU will do
    assert pack_by_default(weights)
    monkeypatch.setattr(cpu_linear, "AUTO_PACK_BUDGET_BYTES", 256 * 256 * 6 - 1)
    assert not pack_by_default(weights)
    assert not pack_by_default([torch.zeros(4, 4, dtype=torch.float16)])


def test_auto_packing_packs_only_where_packing_measured_faster(monkeypatch):
    """The default is timed, not assumed: oneDNN on packed weights was faster on one processor and slower on
    another. Faked timings decide here; the measurement itself runs on real weights and is cached."""
    weights = [torch.randn(512, 64), torch.randn(64, 64), torch.randn(64, 64)]
    calls = []
    monkeypatch.setattr(cpu_linear, "_interleaved_median_s", lambda a, b: calls.append(1) or (1.0, 2.0))
    monkeypatch.setattr(cpu_linear, "_PACKING_PAYS", {})
    assert pack_by_default(weights) and len(calls) == 4  # two shapes x one-token and block rows
    assert pack_by_default(weights) and len(calls) == 4  # cached
    monkeypatch.setattr(cpu_linear, "_interleaved_median_s", lambda a, b: (1.0, 1.02))
    monkeypatch.setattr(cpu_linear, "_PACKING_PAYS", {})
    assert not pack_by_default(weights)  # within the margin: not worth the copies
    assert pack_by_default([torch.zeros(64, 64), torch.zeros(64, 64, dtype=torch.bfloat16)]) is False  # one shape,
    monkeypatch.undo()  # two dtypes: keyed and timed apart
    assert isinstance(cpu_linear.packing_pays(weights), bool)  # the real timing runs


def test_engine_packs_a_small_fp32_target_on_cpu_where_packing_pays(monkeypatch):
    monkeypatch.setattr(cpu_linear, "packing_pays", lambda weights, rows=(1, 16): True)
    target = make_target("llama", dtype=torch.float32)
    engine = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.float32))
    assert engine.pack_weights and engine.fast.packed_layers is not None
    assert isinstance(engine.fast.lm_head, PackedLinear) and isinstance(engine.proposer.lm_head, PackedLinear)
    unpacked = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.float32), pack_weights=False)
    assert unpacked.fast.packed_layers is None and isinstance(unpacked.fast.lm_head, nn.Linear)


@needs_native_bf16
def test_the_drafters_read_out_is_packed_where_packing_pays_for_it(monkeypatch):
    """The default measures the drafter's read-out apart from the target: on an AMX Xeon MKL was faster for the fp32
    target and oneDNN for a bf16 drafter's read-out. Faked here: packing pays for bf16 weights only, at a block's
    rows."""
    asked = []
    monkeypatch.setattr(cpu_linear, "packing_pays",
                        lambda weights, rows=(1, 16): asked.append(rows) or weights[0].dtype == torch.bfloat16)
    target = make_target("llama", dtype=torch.float32)
    engine = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.bfloat16))
    assert not engine.pack_weights and isinstance(engine.fast.lm_head, nn.Linear)
    assert isinstance(engine.proposer.lm_head, PackedLinear) and (4,) in asked
    same_dtype = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.float32))
    assert not isinstance(same_dtype.proposer.lm_head, PackedLinear)
    off = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.bfloat16), pack_weights=False)
    assert not isinstance(off.proposer.lm_head, PackedLinear)


def test_pack_weights_true_on_unpackable_weights_is_a_clear_error():
    target = make_target("qwen3")  # float64
    assert not SpecEngine(target, make_drafter(target)).pack_weights
    with pytest.raises(ValueError, match="pack_weights=True needs fp32 weights.*float64"):
        SpecEngine(target, make_drafter(target), pack_weights=True)


def test_bf16_weights_are_packed_only_where_onednn_multiplies_bf16(monkeypatch):
    """oneDNN packs bf16 weights only on CPUs with a bf16 path (AVX512BW/VL/DQ, AVX-NE-CONVERT, AMX); elsewhere
    (AVX2 alone) the packing call fails, so bf16 weights count as unpackable: auto leaves them, `True` is an error
    for a bf16 target and leaves a bf16 drafter's read-out as it is."""
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "native_bf16_cpu", lambda: False)
    assert not can_pack(weight) and can_pack(weight.float())
    assert not pack_by_default([weight]) and not isinstance(packed_linear(nn.Linear(64, 64).bfloat16()), PackedLinear)
    target = make_target("llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pack_weights=True needs .*bf16 ones on a CPU whose oneDNN.*bfloat16"):
        SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.bfloat16), pack_weights=True)
    target = make_target("llama", dtype=torch.float32)
    engine = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.bfloat16), pack_weights=True)
    assert isinstance(engine.fast.lm_head, PackedLinear) and not isinstance(engine.proposer.lm_head, PackedLinear)


def test_packed_concat_with_some_biases_missing():
    torch.manual_seed(0)
    a, b = nn.Linear(32, 16, bias=False), nn.Linear(32, 8)
    x = torch.randn(4, 32)
    torch.testing.assert_close(packed_concat([a, b])(x), torch.cat([a(x), b(x)], dim=-1), atol=1e-5, rtol=1e-5)
