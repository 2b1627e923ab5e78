"""Our export of a trained drafter (target rope base 1e6) in z-lab's own package, and their layout in ours: DFlash-1
and DFlash2 (trained by `flashdraft train --arch dflash2`; plus a random one made by their own class).

Needs side environments that CI does not build; each test skips cleanly without its own:
- z-lab's package (PyPI `dflash` 0.1.0, transformers 5.15): `bash scripts/speed/setup_zlab_env.sh`
  (~/.cache/flashdraft/venv-zlab, or FLASHDRAFT_ZLAB_PYTHON);
- transformers 4.57 (the remote-code line of their earlier hub checkpoints): `bash scripts/compat/setup_tf457_env.sh`
  (~/.cache/flashdraft/venv-tf457, or FLASHDRAFT_TF457_PYTHON).

The drafter is trained by our pipeline (`scripts/compat/zlab_roundtrip.py: build_pair`, a few seconds on a tiny
target); every comparison is cycle by cycle on held-out prompts: same outputs, same acceptance length in every
cycle, same drafted tokens (z-lab's loop drafts a shorter block once fewer than block_size tokens remain;
those final cycles are not compared, see `compare`). float64 on both
sides, so that equality does not hinge on rounding at near-ties. The full-size figures (float32, more prompts)
come from the script.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("zlab_roundtrip", ROOT / "scripts" / "compat" / "zlab_roundtrip.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)

DTYPE = "float64"
MAX_NEW = 32


def _python(path: Path, what: str) -> Path:
    if not path.is_file():
        pytest.skip(f"no {what} side venv at {path}")
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if not rt.ZLAB_PYTHON.is_file() and not rt.TF457_PYTHON.is_file():
        pytest.skip("no side venv (z-lab's package or transformers 4.57): nothing to compare against")
    import torch

    torch.set_num_threads(min(4, torch.get_num_threads()))
    out = tmp_path_factory.mktemp("roundtrip")
    target_dir, draft_dir, prompts = rt.build_pair(out, rope_theta=1e6, target_steps=150, draft_steps=300)
    prompts = prompts[:8]
    ours = rt.run_ours(target_dir, draft_dir, prompts, MAX_NEW, DTYPE)
    return {"out": out, "target": target_dir, "draft": draft_dir, "prompts": prompts, "ours": ours}


def _assert_same(c: dict):
    assert c["outputs_equal"] == c["prompts"], c
    assert c["acceptance_equal"] == c["prompts"], [(r["ours"], r["theirs"]) for r in c["rows"]]
    assert c["drafts_equal"] == c["prompts"], c
    assert c["compared_cycles"] >= c["prompts"], c


@pytest.fixture(scope="module")
def zlab(pair):
    py = _python(rt.ZLAB_PYTHON, "z-lab dflash")
    saved = pair["out"] / "zlab_saved"
    return rt.run_side(py, "zlab", pair["target"], pair["draft"], pair["prompts"], MAX_NEW, DTYPE, save_to=saved)


def test_export_carries_both_rope_spellings(pair):
    cfg = json.loads((pair["draft"] / "config.json").read_text())
    assert cfg["rope_theta"] == 1e6 and cfg["rope_scaling"] is None
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert (pair["draft"] / "dflash.py").is_file()
    assert pair["ours"]["rope_theta_read"] == 1e6


def test_zlab_package_drafts_our_export_identically(pair, zlab):
    assert zlab["dflash_version"] == "0.1.0" and zlab["rope_theta_read"] == 1e6
    assert zlab["inv_freq_1"] == pytest.approx(pair["ours"]["inv_freq_1"])
    c = rt.compare(pair["ours"], zlab, MAX_NEW, zlab["block_size"])
    _assert_same(c)
    assert c["tau_ours"] > 1.5, c  # a trained drafter: the comparison covers multi-token acceptances


def test_their_layout_loads_in_ours(pair, zlab):
    saved = Path(zlab["saved_to"])
    assert (saved / "config.json").is_file()
    ours_on_theirs = rt.run_ours(pair["target"], saved, pair["prompts"], MAX_NEW, DTYPE)
    assert ours_on_theirs["rope_theta_read"] == 1e6
    _assert_same(rt.compare(ours_on_theirs, zlab, MAX_NEW, zlab["block_size"]))


def test_control_without_rope_base_drafts_differently(pair):
    """The failure the export fixes: a config without the rope base (what 4.57 read from our old export) makes
    z-lab's package draft with base 1e4 - differently, silently."""
    py = _python(rt.ZLAB_PYTHON, "z-lab dflash")
    stripped = rt.strip_rope(pair["draft"], pair["out"] / "no_rope")
    control = rt.run_side(py, "zlab", pair["target"], stripped, pair["prompts"], MAX_NEW, DTYPE)
    assert control["rope_theta_read"] == 10000.0
    c = rt.compare(pair["ours"], control, MAX_NEW, control["block_size"])
    assert c["outputs_equal"] == c["prompts"]  # lossless either way
    assert c["drafts_equal"] < c["prompts"], c


def test_transformers_457_remote_code_line(pair):
    py = _python(rt.TF457_PYTHON, "transformers 4.57")
    r = rt.run_side(py, "remote", pair["target"], pair["draft"], pair["prompts"], MAX_NEW, DTYPE,
                    tokenizer=rt.SHIPPED_TARGET)
    assert r["transformers"].startswith("4.57") and r["rope_theta_read"] == 1e6
    assert r["inv_freq_1"] == pytest.approx(pair["ours"]["inv_freq_1"])
    _assert_same(rt.compare(pair["ours"], r, MAX_NEW, r["block_size"], truncating=False))
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(rt.SHIPPED_TARGET))
    probe = "def f(x):\n    return x + 1\n"
    assert r["tokenizer"]["probe_ids"] == ours(probe)["input_ids"]
    assert r["tokenizer"]["decoded"] == ours.decode(ours(probe)["input_ids"])


# ---- DFlash2 (`flashdraft train --arch dflash2`, z-lab's DFlash2DraftModel) -------------------------------------

@pytest.fixture(scope="module")
def dflash2(pair):
    py = _python(rt.ZLAB_PYTHON, "z-lab dflash")
    _, draft_dir, _ = rt.build_pair(pair["out"], rope_theta=1e6, target_steps=150, draft_steps=300, arch="dflash2")
    ours = rt.run_ours(pair["target"], draft_dir, pair["prompts"], MAX_NEW, DTYPE)
    saved = pair["out"] / "zlab_saved_dflash2"
    theirs = rt.run_side(py, "zlab", pair["target"], draft_dir, pair["prompts"], MAX_NEW, DTYPE, save_to=saved)
    return {"draft": draft_dir, "ours": ours, "zlab": theirs, "python": py}


def test_zlab_package_drafts_our_dflash2_export_identically(pair, dflash2):
    z = dflash2["zlab"]
    assert z["draft_class"] == "DFlash2DraftModel"
    c = rt.compare(dflash2["ours"], z, MAX_NEW, z["block_size"])
    _assert_same(c)
    assert c["tau_ours"] > 1.5, c  # trained: the selector's walk is compared over multi-token acceptances


def test_their_dflash2_layout_loads_in_ours(pair, dflash2):
    saved = Path(dflash2["zlab"]["saved_to"])
    from safetensors.torch import load_file

    assert "candidate_selector.predecessor_codebook" in load_file(str(saved / "model.safetensors"))
    ours_on_theirs = rt.run_ours(pair["target"], saved, pair["prompts"], MAX_NEW, DTYPE)
    _assert_same(rt.compare(ours_on_theirs, dflash2["zlab"], MAX_NEW, dflash2["zlab"]["block_size"]))


def test_dflash2_made_by_their_class_drafts_identically_in_ours(pair, dflash2):
    made_dir, prompts, n = pair["out"] / "zlab_initialised", pair["prompts"][:4], 16  # random: ~1 token a cycle
    made = rt.run_side(dflash2["python"], "zlab", pair["target"], made_dir, prompts, n, DTYPE,
                       init_dflash2=rt.zlab_dflash2_spec(dflash2["draft"]))
    assert "candidate_selector.successor_codebook" in made["initialised"]
    _assert_same(rt.compare(rt.run_ours(pair["target"], made_dir, prompts, n, DTYPE), made, n, made["block_size"]))


def test_zlab_package_drafts_a_whole_vocabulary_selector_identically(pair):
    """`selector_top_k` = the vocabulary (every token a candidate, `flashdraft train --selector-top-k <vocab>`): z-lab's
    package reads the same layout and its walk over all tokens drafts what ours does (ours goes position by
    position without a top-k: `CandidateSelector._walk_vocabulary`)."""
    py = _python(rt.ZLAB_PYTHON, "z-lab dflash")
    options = {**rt.DFLASH2_OPTIONS, "selector_top_k": rt.TINY_VOCAB}
    _, draft_dir, _ = rt.build_pair(pair["out"], rope_theta=1e6, target_steps=150, draft_steps=300, arch="dflash2",
                                    dflash2_options=options)
    assert json.loads((draft_dir / "config.json").read_text())["dflash_config"]["selector_top_k"] == rt.TINY_VOCAB
    ours = rt.run_ours(pair["target"], draft_dir, pair["prompts"], MAX_NEW, DTYPE)
    theirs = rt.run_side(py, "zlab", pair["target"], draft_dir, pair["prompts"], MAX_NEW, DTYPE)
    assert theirs["draft_class"] == "DFlash2DraftModel"
    c = rt.compare(ours, theirs, MAX_NEW, theirs["block_size"])
    _assert_same(c)
    assert c["tau_ours"] > 1.5, c
