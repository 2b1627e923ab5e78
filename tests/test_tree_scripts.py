"""The token-tree scripts still run (scaled down) and compute what they say: scripts/tree/tau_curve.py (tau against
the node budget) and scripts/tree/verify_cost.py (tree verify cost and the speed it projects)."""

from __future__ import annotations

import json

import pytest

from flashdraft.loading import DEFAULT_TARGET
from scripts.tree import tau_curve, verify_cost


def test_tau_curve_smoke(tmp_path):
    if not (DEFAULT_TARGET / "tokenizer.json").is_file():
        pytest.skip("the default pair is not shipped in this checkout")
    out = tmp_path / "curve"
    assert tau_curve.main(["--num", "2", "--max-new-tokens", "8", "--budgets", "0,4", "--t1-budgets", "4",
                           "--batch", "2", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    greedy, sampled = result["curves"]["greedy"], result["curves"]["T = 1 (gumbel)"]
    assert list(greedy) == ["chain", "4"] and list(sampled) == ["4"]
    cells = {"in-domain|mid-line", "in-domain|newline", "ood|mid-line", "ood|newline"}
    for name, row in [*greedy.items(), *sampled.items()]:
        assert set(row) == cells
        for r in row.values():
            # the chain verifies the bonus + 15 drafts; a 4-node tree its root + 4 nodes, at most 4 deep
            assert r["nodes_per_cycle"] == (16 if name == "chain" else 5)
            assert 1.0 <= r["min"] <= r["p10"] <= r["median"] <= 16 and r["mean"] <= (16 if name == "chain" else 5)
    assert set(result["gain_over_chain"]["greedy"]) == cells
    assert (out / "tau.png").stat().st_size > 0 and "| in-domain | mid-line |" in (out / "results.md").read_text()


def test_tau_curve_gain_and_target_check():
    """Gains are tree mean / chain mean per cell; the target names the smallest budget <= 64 reaching 1.12x."""
    def cell(mean):
        return {"mean": mean}

    curve = {"chain": {"a": cell(5.0), "b": cell(4.0)}, "16": {"a": cell(5.5), "b": cell(4.4)},
             "32": {"a": cell(5.7), "b": cell(4.4)}, "128": {"a": cell(7.0), "b": cell(5.0)}}
    assert tau_curve.gains(curve)["a"] == {"chain": 1.0, "16": 1.1, "32": 1.14, "128": 1.4}
    assert tau_curve.target_check(curve) == {"a": "32", "b": None}  # b reaches 1.25x only at 128 > 64 nodes


def test_budget_lists_refuse_bad_input():
    assert tau_curve.parse_budgets("16,0,8,16", "--budgets") == [0, 8, 16]
    for bad in ("", "8,x", "-1", "600"):
        with pytest.raises(SystemExit):
            tau_curve.parse_budgets(bad, "--budgets")


def test_verify_cost_smoke(tmp_path):
    out = tmp_path / "cost.json"
    tau = tmp_path / "tau.json"
    tau.write_text(json.dumps({"curves": {"greedy": {"chain": {"x": {"mean": 4.0}}, "4": {"x": {"mean": 4.5}}}}}))
    assert verify_cost.main(["--tiny", "--iters", "1", "--context", "24", "--rows", "1,2", "--budgets", "4,8",
                             "--tau", str(tau), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [m["rows"] for m in result["measurements"]] == [1, 2]
    for m in result["measurements"]:
        assert {b: t["nodes"] for b, t in m["trees"].items()} == {"4": 5, "8": 9}
        for key in ("step_ms", "chain_verify_ms", "chain_draft_ms"):
            assert 1e-3 < m[key] < 1e4, (key, m)
        assert set(m["projection"]) == {"chain", "4"}  # budget 8 has no tau in the file: no projection
    assert result["load_before"]["top"]


def test_verify_cost_projection_from_known_times():
    """tau * t_step / (t_draft + t_verify + t_walk), per cell and averaged, from hand-picked times."""
    measured = {"step_ms": 2.0, "chain_draft_ms": 1.0, "chain_verify_ms": 3.0,  # chain cycle 4 ms = 2 steps
                "trees": {"16": {"draft_ms": 2.0, "verify_ms": 5.0, "walk_ms": 1.0}}}  # 8 ms = 4 steps
    tau = {"chain": {"a": 6.0, "b": 4.0}, "16": {"a": 8.0, "b": 6.0}}
    proj = verify_cost.projections(measured, tau)
    assert proj["chain"]["per_cell"] == {"a": 3.0, "b": 2.0} and proj["chain"]["mean"] == 2.5
    assert proj["16"]["per_cell"] == {"a": 2.0, "b": 1.5} and proj["16"]["mean"] == 1.75
    assert proj["16"]["cycle_ms"] == 8.0


def test_verify_cost_end_to_end_is_lossless(tmp_path):
    """The engine run beside the projection: every configuration's greedy output equals plain decoding's."""
    if not (DEFAULT_TARGET / "tokenizer.json").is_file():
        pytest.skip("the default pair is not shipped in this checkout")
    out = tmp_path / "cost.json"
    assert verify_cost.main(["--iters", "1", "--context", "24", "--rows", "2", "--budgets", "4", "--e2e-prompts", "3",
                             "--e2e-tokens", "12", "--json", str(out)]) == 0
    e2e = json.loads(out.read_text())["end_to_end"]["2"]
    assert list(e2e) == ["plain", "chain", "4", "auto"]
    assert all(f["same_as_plain"] for f in e2e.values()) and e2e["plain"]["vs_plain"] == 1.0
    assert e2e["plain"]["tau"] == 1.0 and all(f["tau"] > 1.0 for name, f in e2e.items() if name != "plain")
