"""flashdraft and z-lab's own `dflash` package (PyPI `dflash` 0.1.0) coexist in one interpreter.

Ours was renamed from `dflash` to `flashdraft` because z-lab publish their DFlash package as `dflash` (import name
`dflash`, console script `dflash`). This installs their wheel next to ours and checks that both import in one
interpreter from different places, that each console script is its owner's, and that no installed file or
top-level name clashes.

Their wheel is installed with --no-deps into a temporary target dir (PYTHONPATH), not into our venv: their
requirements are exact pins (`tqdm==4.70.0`, `datasets==5.0.1`, and with the `local` extra `transformers==5.15.0`,
`torch==2.13.0`), and `transformers==5.15.0` cannot be resolved together with our `transformers>=5.23` (nor
`datasets==5.0.1` with our `train`/`bench` extras' `datasets<5`). `import dflash` needs none of them (it loads its
modules lazily); `dflash.model` imports under our transformers too, which this test checks.

The wheel is cached under ~/.cache/flashdraft/wheels (FLASHDRAFT_WHEEL_CACHE); the test skips only when the wheel
is not cached and PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ZLAB_VERSION = "0.1.0"
WHEEL = f"dflash-{ZLAB_VERSION}-py3-none-any.whl"
CACHE = Path(os.environ.get("FLASHDRAFT_WHEEL_CACHE", Path.home() / ".cache" / "flashdraft" / "wheels"))


def _pypi_reachable() -> bool:
    for host in ("pypi.org", "files.pythonhosted.org"):
        try:
            socket.create_connection((host, 443), timeout=5).close()
        except OSError:
            return False
    return True


def _zlab_wheel() -> Path:
    wheel = CACHE / WHEEL
    if wheel.is_file():
        return wheel
    CACHE.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                          "--dest", str(CACHE), f"dflash=={ZLAB_VERSION}"], capture_output=True, text=True,
                         timeout=120)
    if wheel.is_file():
        return wheel
    if not _pypi_reachable():
        pytest.skip(f"PyPI unreachable and {wheel} not cached: cannot fetch z-lab's dflash {ZLAB_VERSION}")
    raise AssertionError(f"pip download dflash=={ZLAB_VERSION} failed although PyPI is reachable:\n"
                         f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")


CHECK = r"""
import importlib.metadata as md, json, os, sys
import dflash, flashdraft
import dflash.model  # their model code, under OUR transformers
from dflash import DFlashDraftModel as Theirs
from flashdraft import DFlashDraftModel as Ours
eps = {e.name: e.value for e in md.entry_points(group="console_scripts") if e.name in ("dflash", "flashdraft")}
dists = {name: sorted(set(ds)) for name, ds in md.packages_distributions().items() if name in ("dflash", "flashdraft")}
files = {d: sorted(str(f) for f in (md.files(d) or [])) for d in ("dflash", "flashdraft")}
reqs = md.requires("dflash")
import transformers
print(json.dumps({
    "dflash_file": dflash.__file__, "flashdraft_file": flashdraft.__file__,
    "dflash_version": md.version("dflash"), "flashdraft_version": md.version("flashdraft"),
    "theirs": Theirs.__module__ + "." + Theirs.__qualname__, "ours": Ours.__module__ + "." + Ours.__qualname__,
    "entry_points": eps, "dists": dists, "files": files, "requires": reqs,
    "transformers": transformers.__version__,
}))
"""


@pytest.fixture(scope="module")
def zlab_site(tmp_path_factory):
    """z-lab's wheel installed with --no-deps into a target dir (their `bin/dflash` script included)."""
    wheel = _zlab_wheel()
    site = tmp_path_factory.mktemp("zlab") / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return site


def test_zlab_dflash_and_flashdraft_coexist(zlab_site):
    site = zlab_site
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])

    # both import, from different packages: theirs from the target dir, ours from this checkout
    dflash_pkg = Path(info["dflash_file"]).resolve().parent
    flashdraft_pkg = Path(info["flashdraft_file"]).resolve().parent
    assert dflash_pkg == (site / "dflash").resolve()
    assert flashdraft_pkg == (Path(__file__).resolve().parents[1] / "flashdraft")
    assert info["dflash_version"] == ZLAB_VERSION
    assert info["theirs"] == "dflash.model.DFlashDraftModel"
    assert info["ours"].startswith("flashdraft.")

    # each console script belongs to its own package
    assert info["entry_points"] == {"dflash": "dflash.cli:main", "flashdraft": "flashdraft.cli:main"}
    assert info["dists"] == {"dflash": ["dflash"], "flashdraft": ["flashdraft"]}
    assert (site / "bin" / "dflash").is_file()
    ours_script = Path(sys.executable).parent / "flashdraft"
    assert ours_script.is_file(), f"our console script {ours_script} is missing"
    assert "flashdraft.cli" in ours_script.read_text()
    assert not (Path(sys.executable).parent / "dflash").exists() or "flashdraft" not in (
        Path(sys.executable).parent / "dflash").read_text(), "our venv holds a `dflash` script of ours"

    # no installed file in common; none of ours under a top-level `dflash`
    theirs_files, ours_files = set(info["files"]["dflash"]), set(info["files"]["flashdraft"])
    assert theirs_files and ours_files
    assert not theirs_files & ours_files
    assert not any(f.split("/")[0] == "dflash" for f in ours_files)
    assert all(f.split("/")[0] in ("dflash", "dflash-0.1.0.dist-info") or f.startswith("../../bin/dflash")
               or f.startswith("bin/") for f in theirs_files), sorted(theirs_files)

    # the dependency facts that keep their package out of our venv (see the module docstring)
    reqs = info["requires"]
    assert any(r.replace(" ", "").startswith("transformers==5.15.0") for r in reqs), reqs
    assert any(r.replace(" ", "").startswith("datasets==5.0.1") for r in reqs), reqs
    major, minor = (int(x) for x in info["transformers"].split(".")[:2])
    assert (major, minor) >= (5, 23), info["transformers"]


def test_dflash_console_script_is_theirs(zlab_site):
    """`dflash --help` runs z-lab's CLI (its generate / benchmark commands), `flashdraft --help` ours."""
    site = zlab_site
    env = dict(os.environ, PYTHONPATH=str(site))
    theirs = subprocess.run([sys.executable, str(site / "bin" / "dflash"), "--help"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert theirs.returncode == 0, theirs.stderr
    assert theirs.stdout.startswith("usage: dflash") and "benchmark" in theirs.stdout
    ours = subprocess.run([str(Path(sys.executable).parent / "flashdraft"), "--help"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert ours.returncode == 0, ours.stderr
    assert "flashdraft" in ours.stdout.splitlines()[0]
