"""scripts/speed/policy_replay.py: the fixed block and the best possible mix are computed right, the policy replay
runs the real policy (a variant's constants reach it), collected traces are the engine's own acceptance lengths,
and bad input is a one-line error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "speed"))

import policy_replay  # noqa: E402

from flashdraft.engine import policy  # noqa: E402


def test_fixed_and_best_costs():
    # every block accepts 16: the fixed block is 4 cycles for 64 tokens, and nothing beats it
    assert policy_replay.fixed_cost([16] * 64, 2.5) == 10.0
    assert policy_replay.best_cost([16] * 64, 1.0, 2.5) == 10.0
    # drafts that always fail: one-token steps are best, the fixed block pays a cycle per token
    assert policy_replay.fixed_cost([1] * 10, 2.5) == 25.0 and policy_replay.best_cost([1] * 10, 1.0, 2.5) == 10.0
    # a bad stretch, then a good one: step through the first, draft the second
    lengths = [1, 1, 1] + [16] * 16
    assert policy_replay.best_cost(lengths, 1.0, 2.5) == 3 + 2.5


def test_replay_runs_the_policy_and_its_variants(tmp_path, capsys):
    traces = {"good": [[16] * 64, [12] * 48], "failing": [[1] * 120]}
    path = tmp_path / "traces.json"
    path.write_text(json.dumps(traces))
    out = tmp_path / "report.json"
    assert policy_replay.main(["replay", str(path), "--variant", "slow:SMOOTHING=0.1",
                               "--json", str(out)]) == 0
    sets = json.loads(out.read_text())["sets"]
    good, failing = sets["good"], sets["failing"]
    assert good["best"] >= good["fixed"] and failing["best"] == pytest.approx(1.0)
    assert good["default"] == pytest.approx(good["fixed"], rel=0.1)  # good drafts: it drafts the block
    assert failing["default"] > 1.5 * failing["fixed"]  # failing drafts: it steps, the fixed block loses
    assert sets["failing"]["default_cycles_steps"][1] > 100
    assert "slow" in good and policy.SMOOTHING == 0.3  # the variant ran, its constant restored after
    assert "best possible" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["replay", "missing.json"], ["replay", "{bad}"], ["replay", "x", "--noise", "-1"],
                                  ["collect", "--sets", "nowhere", "--out", "x.json"]])
def test_bad_input_is_a_one_line_error(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "{bad}").write_text("[1, 2]")
    with pytest.raises(SystemExit) as e:
        policy_replay.main(argv)
    assert e.value.code == 2 and "error: " in capsys.readouterr().err.strip().splitlines()[-1]


def test_collected_lengths_are_the_fixed_engines_first_cycles(tmp_path):
    out = tmp_path / "traces.json"
    assert policy_replay.main(["collect", "--sets", "held-out", "--num-prompts", "1", "--max-tokens", "4",
                               "--out", str(out)]) == 0
    traces = json.loads(out.read_text())
    (lengths,) = traces["held-out"]
    assert len(lengths) == 4 and all(1 <= n <= 16 for n in lengths)
