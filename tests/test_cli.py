"""`flashdraft generate` end to end on a tiny target + drafter saved to disk with the project's tokenizer."""

import json

import pytest
import torch

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


def _generate(pair, capsys, *extra):
    code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--prompt",
                 "import os", "--max-new-tokens", "40", "--device", "cpu", *extra])
    assert code == 0
    return capsys.readouterr().out


def test_generate_stream_and_stop_string(pair, capsys):
    full = json.loads(_generate(pair, capsys, "--json"))
    assert full["finish_reason"] == "length"
    text = full["text"]
    # a stop string from the middle of the unstopped text: plain characters, so that no partial UTF-8 byte
    # sequence or tokenizer artefact can make the stopped decode differ from the full one before it
    start = next(k for k in range(len(text) // 3, len(text) - 3) if text[k:k + 3].isascii() and text[k:k + 3].isalnum())
    stop = text[start:start + 3]
    expected = text[: text.find(stop)]
    assert 0 < len(expected) <= start and len(expected) + len(stop) < len(text)

    out = _generate(pair, capsys, "--stream", "--stop", stop)
    streamed, sep, summary = out.rpartition("\n\n-- ")
    assert sep, out
    assert streamed == expected  # everything before the stop string, the stop string itself not included
    assert "finish=stop" in summary and "tau=" in summary and "tok/s" in summary

    stopped = json.loads(_generate(pair, capsys, "--json", "--stop", stop))
    assert stopped["text"] == streamed and stopped["finish_reason"] == "stop"
    assert stopped["stats"]["output_tokens"] < full["stats"]["output_tokens"]
    plain = _generate(pair, capsys, "--stop", stop)
    assert plain.rpartition("\n\n-- ")[0] == "import os" + streamed


def test_generate_logprobs(pair, capsys):
    report = json.loads(_generate(pair, capsys, "--json", "--logprobs", "3"))
    logprobs = report["logprobs"]
    assert len(logprobs) == report["stats"]["output_tokens"] and "".join(e["text"] for e in logprobs) == report["text"]
    for e in logprobs:  # the chosen token is at most as likely as the most likely one, and both are probabilities
        assert len(e["top"]) == 3 and e["logprob"] <= e["top"][0]["logprob"] + 1e-6 <= 1e-6
    printed = _generate(pair, capsys, "--logprobs", "1")
    assert printed.count("top: ") == report["stats"]["output_tokens"]


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
    assert code == 2 and "pack_weights=True needs fp32 weights" in capsys.readouterr().err


def test_bad_words_through_the_cli_are_the_targets_own_with_them_banned(pair, capsys):
    """`--bad-word`: a word of the free output (as written or after a space) never completes again, and `--compare`
    checks the result against the target's own generate with the same words banned as vLLM reads them."""
    from flashdraft.bench.reference import OutputBadWords

    free = json.loads(_generate(pair, capsys, "--json"))["text"]
    word = next(w for w in free.split() if w.isalnum())
    banned = json.loads(_generate(pair, capsys, "--json", "--compare", "--bad-word", word))
    assert banned["identical_to_target_generate"] is True and banned["text"] != free
    scores = torch.zeros(1, 8)
    words = ((1, 2), (5,), (9, 7, 1, 4))  # the last one would match were the prompt [1, 9] read
    OutputBadWords(words, prompt_len=2)(torch.tensor([[1, 9, 7, 1]]), scores)
    assert scores[0].tolist() == [0, 0, float("-inf"), 0, 0, float("-inf"), 0, 0]
