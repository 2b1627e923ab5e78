"""`dflash generate` end to end on a tiny target + drafter saved to disk with the project's tokenizer."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dflash import DFlashDraftModel, make_draft_config
from dflash.cli import main

TOKENIZER = Path(__file__).resolve().parent.parent / "dflash" / "assets" / "default_pair" / "target"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    for f in TOKENIZER.iterdir():
        shutil.copy(f, root / "target" / f.name)
    drafter = DFlashDraftModel(make_draft_config(cfg, num_layers=1, block_size=8, mask_token_id=tok.mask_token_id))
    drafter.save_pretrained(root / "drafter")
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
