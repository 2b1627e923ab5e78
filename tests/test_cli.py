"""`flashdraft generate` end to end on a tiny target + drafter saved to disk with the project's tokenizer."""

import json

import pytest

from flashdraft.cli import main
from tiny import save_text_pair

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    save_text_pair(root)
    return root


def test_generate_json_with_comparison(pair, capsys):
    code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--prompt",
                 "def add(a, b):", "--max-new-tokens", "24", "--json", "--compare", "--device", "cpu"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stats"]["output_tokens"] > 0 and report["stats"]["block_size"] == 8
    assert report["baseline"]["identical_output"] is True
    assert isinstance(report["text"], str) and report["finish_reason"] in ("stop", "length")
    assert len(report["stats"]["acceptance_histogram"]) == 8


def test_generate_stream_and_stop_string(pair, capsys):
    code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--prompt",
                 "import os", "--max-new-tokens", "16", "--stream", "--device", "cpu"])
    assert code == 0
    out = capsys.readouterr().out
    assert "tau=" in out and "tok/s" in out


def test_bad_arguments_give_clear_errors(pair, capsys):
    code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--prompt", "x",
                 "--temperature", "-1", "--device", "cpu"])
    assert code == 2 and "temperature" in capsys.readouterr().err
    code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "nope"), "--prompt", "x",
                 "--device", "cpu"])
    assert code == 2 and "no such directory" in capsys.readouterr().err


def test_pack_weights_flag(pair, capsys):
    outputs = {}
    for mode in ("on", "off"):
        code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--prompt",
                     "def add(a, b):", "--max-new-tokens", "24", "--json", "--device", "cpu", "--pack-weights", mode])
        assert code == 0
        outputs[mode] = json.loads(capsys.readouterr().out)["text"]
    assert outputs["on"] == outputs["off"]
    code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--prompt", "x",
                 "--device", "cpu", "--dtype", "float16", "--pack-weights", "on"])
    assert code == 2 and "pack_weights=True needs fp32 or bf16 weights" in capsys.readouterr().err
