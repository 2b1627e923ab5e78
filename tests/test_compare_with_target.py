"""`flashdraft generate --compare` and `flashdraft demo` check losslessness against the TARGET's own transformers
`generate` on its unpacked weights, not against plain decoding through our own engine.

The failing cases break the engine itself (every run, DFlash and plain decoding alike, flips one token): a check
against our own plain decoding would still say "identical", a check against the target must say DIFFER."""

import json

import pytest
import torch

from flashdraft.bench.reference import compare_with_target, target_greedy_generate
from flashdraft.cli import main
from flashdraft.engine import SamplingParams, SpecEngine
from tiny import save_text_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmppair")
    save_text_pair(root, block_size=4, lm_head_scale=4.0)  # sharp logits: no fp near-ties in float64
    return root


def _models(pair):
    return ["--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--device", "cpu",
            "--dtype", "float64"]


@pytest.fixture
def broken_engine(monkeypatch):
    """Every SpecEngine.generate result gets one token changed: DFlash and plain decoding agree, both wrong."""
    real = SpecEngine.generate

    def generate(self, prompts, params=None):
        results = real(self, prompts, params)
        for r in results:
            if len(r.token_ids) > 2:
                j = len(r.token_ids) // 2
                r.token_ids[j] = (r.token_ids[j] + 1) % 8192
        return results

    monkeypatch.setattr(SpecEngine, "generate", generate)


def test_generate_compare_passes_against_target(pair, capsys):
    code = main(["generate", *_models(pair), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--compare"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "identical to the target's own greedy generate (transformers, unpacked weights)" in out
    code = main(["generate", *_models(pair), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--compare",
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["identical_to_target_generate"] is True
    assert "transformers" in report["target_generate"]["compared_with"]
    assert report["target_generate"]["first_difference_at"] is None


def test_generate_compare_catches_a_wrong_engine(pair, capsys, broken_engine):
    code = main(["generate", *_models(pair), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--compare",
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["baseline"]["identical_output"] is True  # our own plain decoding agrees with the broken DFlash ...
    assert report["identical_to_target_generate"] is False  # ... the target does not
    assert code == 1
    assert report["target_generate"]["first_difference_at"] == report["stats"]["output_tokens"] // 2
    code = main(["generate", *_models(pair), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--compare"])
    out = capsys.readouterr().out
    assert code == 1 and "DIFFER from the target's own greedy generate" in out and "first difference at token" in out
    assert "near-ties" in out


def test_generate_compare_sampling_is_not_claimed(pair, capsys):
    code = main(["generate", *_models(pair), "--prompt", "x = ", "--max-new-tokens", "8", "--compare", "--json",
                 "--temperature", "1", "--seed", "0"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["identical_to_target_generate"] is None


def _demo(pair, tmp_path):
    out = tmp_path / "demo.json"
    return ["demo", *_models(pair), "--num-prompts", "2", "--max-new-tokens", "16", "--show", "1",
            "--json", str(out)], out


def test_demo_passes_against_target(pair, tmp_path, capsys):
    argv, out = _demo(pair, tmp_path)
    code = main(argv)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "losslessness: PASS - identical to the target's own greedy generate (transformers, unpacked weights): 2/2" \
        in printed
    res = json.loads(out.read_text())
    assert res["identical_to_target_generate"]["identical"] == 2
    assert all(r["identical_to_target_generate"] is True for r in res["prompts"])


def test_demo_catches_a_wrong_engine(pair, tmp_path, capsys, broken_engine):
    argv, out = _demo(pair, tmp_path)
    code = main(argv)
    printed = capsys.readouterr().out
    assert code == 1
    assert "losslessness: DIFFER" in printed and "0/2" in printed and "first difference at token" in printed
    res = json.loads(out.read_text())
    assert res["identical_to_target_generate"]["identical"] == 0
    assert all(r["identical_to_target_generate"] is False and "first_difference_at" in r for r in res["prompts"])


def test_target_generate_stops_where_the_engine_stops(pair):
    """A stop id that occurs in the middle of the greedy continuation: both stop right after its first occurrence."""
    from flashdraft.loading import load_pair

    target, tok, drafter = load_pair(pair / "target", pair / "drafter", "cpu", "float64")
    prompt = tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    saved = target.generation_config
    free = target_greedy_generate(target, prompt, SamplingParams(max_new_tokens=24))
    assert len(free) == 24
    stop = free[10]
    first = free.index(stop)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(stop,))
    assert target_greedy_generate(target, prompt, params) == free[:first + 1]
    result = SpecEngine(target, drafter, tok).generate([prompt], params)[0]
    check = compare_with_target(target, prompt, params, result)
    assert check["identical"] and check["tokens"] == first + 1 == check["target_tokens"]
    assert target.generation_config is saved  # the checkpoint's own generation config is put back
    # a stop string cuts our output; the target's is compared over the same number of tokens
    text = tok.decode(free[:12])
    stop_str = text[-3:] if text[-3:].strip() else text[-4:]
    sp = SamplingParams(max_new_tokens=24, stop_strings=(stop_str,))
    res = SpecEngine(target, drafter, tok).generate([prompt], sp)[0]
    assert res.finish_reason == "stop"
    check = compare_with_target(target, prompt, sp, res)
    assert check["identical"], check
    assert torch.equal(torch.tensor(res.token_ids), torch.tensor(free[:len(res.token_ids)]))
