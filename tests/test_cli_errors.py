"""Every user error of the command line is one line on stderr (no traceback) and a nonzero exit: bad paths, devices,
out-of-range numbers, a target without a drafter, the wrong kind of checkpoint, corrupt files, missing optional
dependencies. Nothing silent: no random weights, no quiet fallback to plain decoding."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft.cli import main
from tiny import save_text_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("errpair")
    save_text_pair(root, block_size=4, lm_head_scale=4.0)
    return root


def _one_line_error(capsys, argv, needles=(), code=2, entry=main):
    rc = entry(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert rc == code, (rc, err)
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _gen(pair, *extra, target=None, draft=None):
    return ["generate", "--target", str(target or pair / "target"), "--draft", str(draft or pair / "drafter"),
            "--prompt", "def f(x):", "--max-new-tokens", "4", "--device", "cpu", *extra]


# ---- paths ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/nonexistent/model", "./no-such-model-dir", "a/b/c"])
def test_missing_target_path(pair, capsys, path):
    _one_line_error(capsys, _gen(pair, target=path), ["no such directory", path])


def test_missing_draft_path(pair, capsys):
    _one_line_error(capsys, _gen(pair, draft="/nonexistent/drafter"), ["no such directory"])


def test_hub_ids_are_still_accepted_as_such():
    from flashdraft.loading import check_model_path

    assert check_model_path("org/name") is None and check_model_path("gpt2") is None  # left to the hub
    with pytest.raises(FileNotFoundError):
        check_model_path("./org/name")


def test_target_pointed_at_a_drafter(pair, capsys):
    _one_line_error(capsys, _gen(pair, target=pair / "drafter"), ["DFlash drafter checkpoint"])


def test_target_missing_weights_is_refused(pair, tmp_path, capsys):
    bad = tmp_path / "partial"
    bad.mkdir()
    for f in (pair / "target").iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(pair / "target" / "model.safetensors"))
    state.pop("model.norm.weight")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _one_line_error(capsys, _gen(pair, target=bad), ["lacks weights", "model.norm.weight"])


def test_truncated_target_and_drafter(pair, tmp_path, capsys):
    for name in ("target", "drafter"):
        bad = tmp_path / name
        bad.mkdir()
        for f in (pair / name).iterdir():
            data = f.read_bytes()
            (bad / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    _one_line_error(capsys, _gen(pair, target=tmp_path / "target"), ["cannot load the model"])
    _one_line_error(capsys, _gen(pair, draft=tmp_path / "drafter"), ["corrupt or truncated"])


def test_draft_config_is_checked_before_the_weights(pair, tmp_path, capsys):
    bad = tmp_path / "not-a-drafter"
    bad.mkdir()
    (bad / "config.json").write_text((pair / "target" / "config.json").read_text())  # a target's config
    (bad / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 10)
    err = _one_line_error(capsys, _gen(pair, draft=bad), ["no dflash_config"])
    assert "safetensors" not in err
    _one_line_error(capsys, _gen(pair, draft=pair / "target"), ["no dflash_config"])


def test_corrupt_tokenizer_is_an_error_missing_one_is_not(pair, tmp_path, capsys):
    from flashdraft.loading import load_tokenizer

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (pair / "target").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    _one_line_error(capsys, _gen(pair, target=broken), ["cannot load the tokenizer"])
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in (pair / "target").iterdir():
        if not f.name.startswith("tokenizer"):
            (bare / f.name).write_bytes(f.read_bytes())
    assert load_tokenizer(bare) is None
    _one_line_error(capsys, _gen(pair, target=bare), ["no tokenizer"])


# ---- devices and numbers ----------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(pair, capsys):
    _one_line_error(capsys, _gen(pair, "--device", "cuda"), ["--device", "CUDA is not available"])
    _one_line_error(capsys, ["demo", "--device", "cuda:0"], ["CUDA is not available"])


@pytest.mark.parametrize("flags,needle", [
    (["--device", "bogus"], "unknown device"),
    (["--dtype", "float13"], "unknown dtype"),
    (["--threads", "-1"], "--threads"),
    (["--threads", "0"], "--threads"),
    (["--block-size", "0"], "--block-size"),
    (["--block-size", "-4"], "--block-size"),
    (["--block-size", "1"], "--no-draft"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-tau", "0.5"], "--min-tau"),
    (["--threads", "two"], "expected an integer"),
    (["--screen-greedy", "maybe"], "--screen-greedy"),
    (["--screen-greedy", "on", "--exact"], "screen_greedy=True but exact mode"),
])
def test_out_of_range_flags(pair, capsys, flags, needle):
    _one_line_error(capsys, _gen(pair, *flags), [needle])


@pytest.mark.parametrize("flags", [["--max-new-tokens", "0"], ["--temperature", "-1"], ["--num-prompts", "-1"],
                                   ["--block-size", "0"], ["--threads", "0"]])
def test_demo_flags(capsys, flags):
    _one_line_error(capsys, ["demo", *flags])


@pytest.mark.parametrize("flags", [["--max-new-tokens", "-3"], ["--top-p", "2"], ["--num-assistant-tokens", "0"],
                                   ["--concurrency", "0,4"], ["--block-size", "0"], ["--min-tau", "-1"]])
def test_bench_flags(capsys, flags):
    from flashdraft.bench.cli import main as bench_main

    _one_line_error(capsys, ["bench", *flags])
    _one_line_error(capsys, flags, entry=bench_main)


# ---- a target without a drafter -------------------------------------------------------------------------------

def test_target_without_draft_is_refused(pair, tmp_path, capsys):
    t = str(pair / "target")
    _one_line_error(capsys, ["generate", "--target", t, "--prompt", "x", "--device", "cpu"],
                    ["--target needs --draft (or --no-draft for plain decoding)"])
    _one_line_error(capsys, ["demo", "--target", t, "--device", "cpu"], ["--target needs --draft"])
    _one_line_error(capsys, ["bench", "--target", t, "--device", "cpu", "--output-dir", str(tmp_path / "b")],
                    ["--target needs --draft", "--no-draft"])
    _one_line_error(capsys, _gen(pair, "--no-draft"), ["contradict"])


def test_no_draft_is_plain_decoding(pair, capsys):
    code = main(["generate", "--target", str(pair / "target"), "--no-draft", "--prompt", "def f(x):",
                 "--max-new-tokens", "6", "--device", "cpu", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stats"]["block_size"] == 1


# ---- bench: results before plots, optional imports up front ----------------------------------------------------

def _bench_args(pair, out, *extra):
    return ["--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--methods", "ar,dflash",
            "--dataset", "default", "--num-prompts", "1", "--device", "cpu", "--max-new-tokens", "6",
            "--output-dir", str(out), "--no-progress", *extra]


def test_bench_checks_matplotlib_before_loading_models(pair, tmp_path, capsys, monkeypatch):
    import importlib.util

    import flashdraft.bench.offline as offline

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(offline, "load_models", lambda cfg: pytest.fail("models loaded before the import check"))
    from flashdraft.bench.cli import main as bench_main

    _one_line_error(capsys, _bench_args(pair, tmp_path / "out"), ["matplotlib", "flashdraft[bench]"],
                    entry=bench_main)
    assert not (tmp_path / "out").exists()


def test_bench_writes_results_before_plots(pair, tmp_path, monkeypatch):
    from flashdraft.bench import report
    from flashdraft.bench.cli import main as bench_main

    def broken_plots(results, out_dir):
        raise RuntimeError("plotting broke")

    monkeypatch.setattr(report, "write_plots", broken_plots)
    with pytest.raises(RuntimeError, match="plotting broke"):
        bench_main(_bench_args(pair, tmp_path / "out"))
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["losslessness"]["checked"] is True and (tmp_path / "out" / "results.md").is_file()


# ---- as a real process: one line, no traceback -------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "x", "--device", "bogus"], "unknown device"),
    (["generate", "--prompt", "x", "--target", "/nonexistent/x", "--draft", "/nonexistent/y", "--device", "cpu"],
     "no such directory"),
])
def test_subprocess_one_line(argv, needle):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "flashdraft.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert needle in proc.stderr


def test_bench_no_draft_runs_the_methods_without_a_drafter(pair, tmp_path, capsys):
    from flashdraft.bench.cli import main as bench_main

    argv = _bench_args(pair, tmp_path / "out", "--no-plots")
    argv[argv.index("--draft"):argv.index("--draft") + 2] = ["--no-draft"]
    assert bench_main(argv) == 0, capsys.readouterr()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [m["name"] for m in results["methods"]] == ["ar"]
