"""The speed scripts kept in the repo still run (scaled down): the GPU shape benchmark and the side-by-side bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "speed"))

import bench_speed  # noqa: E402
import gpu_shapes  # noqa: E402


def test_gpu_shapes_smoke(tmp_path):
    out = tmp_path / "shapes.json"
    assert gpu_shapes.main(["--tiny", "--device", "cpu", "--batch-sizes", "1,2", "--iters", "2", "--context", "48",
                            "--modes", "eager", "--tau", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    for r in report["rows"]:
        assert min(r["ar_ms"], r["verify_ms"], r["draft_ms"]) > 0
        assert abs(r["projected_speedup"] - 4 * r["ar_ms"] / (r["verify_ms"] + r["draft_ms"])) < 1e-9


def test_bench_speed_smoke(tmp_path):
    """Every method (ours, plain, transformers generate and DFlash, reference-style) gives the same greedy tokens."""
    out = tmp_path / "speed.json"
    assert bench_speed.main(["--num-prompts", "2", "--max-new-tokens", "24", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["identical"].values()) == {2} and report["tau"] > 1
    assert "reference-style loop" in report["tokens_per_second"]
