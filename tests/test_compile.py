"""Compiled draft and verify steps (SpecEngine(compile=True)): still lossless, and one graph per block size.

Skipped where torch.compile cannot build CPU kernels (no C++ compiler).
"""

from __future__ import annotations

import pytest
import torch

from dflash.engine import SamplingParams, SpecEngine
from dflash.engine.compiled import compile_unavailable
from tiny import OracleProposer, greedy_reference, make_drafter, make_target

pytestmark = pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None,
                                reason=str(compile_unavailable(torch.device("cpu"))))

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30, 12, 4, 19, 22], list(range(20, 58))]
MAX_NEW = 24


@pytest.fixture(scope="module")
def qwen3():
    target = make_target("qwen3")
    return target, [greedy_reference(target, p, MAX_NEW) for p in PROMPTS]


def test_compiled_dflash_is_lossless_and_does_not_recompile_per_request(qwen3):
    target, expected = qwen3
    engine = SpecEngine(target, make_drafter(target, block_size=4), compile=True)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    assert engine.generate([PROMPTS[0]], params)[0].token_ids == expected[0]
    # other prompt lengths at batch 1 reuse the same graphs: shapes are static per block size
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt, want in zip(PROMPTS[1:], expected[1:]):
            assert engine.generate([prompt], params)[0].token_ids == want
    # a batch of rows with different lengths (a new batch shape: recompiles are allowed here)
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected


def test_compiled_verify_with_long_accepted_runs(qwen3):
    """The oracle drafter gets whole blocks accepted, then rejected at random positions, across rows."""
    target, expected = qwen3
    refs = {i: p + e for i, (p, e) in enumerate(zip(PROMPTS, expected))}
    engine = SpecEngine(target, block_size=6, proposer=OracleProposer(refs, seed=3), compile=True)
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == expected
    assert max(max(r.stats.acceptance_lengths) for r in results) == 6  # some whole blocks accepted


def test_compile_needs_the_fast_path():
    target = make_target("gemma")
    with pytest.raises(ValueError, match="fast target path"):
        SpecEngine(target, make_drafter(target), compile=True)
