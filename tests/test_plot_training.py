"""scripts/drafter/plot_training.py: training curves read from train_log.jsonl."""

import json

import numpy as np
import pytest

from scripts.drafter.plot_training import main, read_log, smooth


def _log(path, steps, selector=True):
    lines = [{"step": 0, "eval_tau": 3.0}]  # an evaluation line: no loss, skipped
    for s in steps:
        row = {"step": s, "loss": 2.0 / s, "lr": 1e-4, "acc_per_position": [0.5, 0.3, 0.1]}
        if selector:
            row["selector_acc"] = 0.2
        lines.append(row)
    path.mkdir()
    (path / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_steps_are_read_and_evaluation_lines_skipped(tmp_path):
    _log(tmp_path / "a", [1, 2, 4])
    log = read_log(tmp_path / "a")
    assert log["step"].tolist() == [1, 2, 4]
    assert log["all positions"] == pytest.approx([0.3] * 3) and log["first position"].tolist() == [0.5] * 3


def test_the_moving_average_trails_and_skips_missing_values():
    assert smooth(np.array([1.0, 3.0, np.nan, 5.0]), 2).tolist() == [1.0, 2.0, 3.0, 5.0]


def test_runs_with_and_without_a_selector_plot_side_by_side(tmp_path, capsys):
    _log(tmp_path / "d2", [1, 2, 3])
    _log(tmp_path / "d1", [1, 2, 3], selector=False)
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "d2"), str(tmp_path / "d1"), "--smooth", "2", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "d2: step 3" in printed and "selector 0.2" in printed and "selector" not in printed.split("d1:")[1]


def test_a_missing_log_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="error: .*nothing"):
        main([str(tmp_path / "nothing")])
