"""Corpus for the shipped default target: the Python standard library source.

The corpus is the ``*.py`` source of the standard library of the *running*
interpreter (``sysconfig.get_paths()["stdlib"]``, PSF licence), without test
folders, ``site-packages``, ``__pycache__`` and files over 200 KB. Files are split
deterministically into train / held-out by a hash of their relative path, so the
split does not depend on file-system order or on the machine.

Command line (from the repository root)::

    python scripts/default_pair/corpus.py            # writes data/default_pair/corpus/
    python scripts/default_pair/corpus.py --force    # rebuild even if present

Python API (from the repository root, ``scripts`` is a namespace package)::

    from scripts.default_pair.corpus import load_corpus, heldout_prompts, train_prompts
    docs = load_corpus("train")            # list of {"path": str, "text": str}
    prompts = heldout_prompts(64)          # list[str], deterministic
    prompts = train_prompts(10_000)        # list[str], deterministic
    recs = heldout_prompts(8, with_meta=True)  # list of {"path", "lineno", "kind", "name", "prompt"}

A prompt is the start of a function or class: the ``context_lines`` lines that
precede it in the file (default 3, taken verbatim), its decorators, its full
``def``/``class`` header and, when it has a docstring, the docstring's first line.
Prompts stop at the end of that last line *without* its newline: the byte-level BPE
merges a newline with the indentation that follows it, so a prompt ending in a bare
``"\n"`` would push the model towards column-0 code; without it the model goes on with
its own ``"\n" + indentation`` token. The model is asked to continue the prompt.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Iterable

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "data" / "default_pair" / "corpus"

MAX_FILE_BYTES = 200 * 1024
HELDOUT_PERCENT = 5
# Any path component with one of these names excludes the file.
EXCLUDED_COMPONENTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
# Explicit sub-paths (already covered by the component rule, listed for clarity).
EXCLUDED_PREFIXES = ("idlelib/idle_test/", "lib2to3/tests/")
SPLITS = ("train", "heldout")


# --------------------------------------------------------------------------- collection


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def split_of(relpath: str) -> str:
    """Deterministic split: sha1(relpath) % 100 < HELDOUT_PERCENT -> held-out."""
    h = int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16)
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def _excluded(relpath: str) -> bool:
    parts = relpath.split("/")
    if any(p in EXCLUDED_COMPONENTS for p in parts[:-1]):
        return True
    return relpath.startswith(EXCLUDED_PREFIXES)


def collect(root: Path | None = None) -> tuple[dict[str, list[dict]], dict]:
    """Walks the stdlib and returns ({split: [{"path", "text"}]}, stats)."""
    root = root or stdlib_dir()
    docs: dict[str, list[dict]] = {s: [] for s in SPLITS}
    stats = {"skipped_too_large": [], "skipped_not_utf8": [], "skipped_empty": 0}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_COMPONENTS)
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            full = Path(dirpath) / fn
            rel = full.relative_to(root).as_posix()
            if _excluded(rel) or full.is_symlink():
                continue
            size = full.stat().st_size
            if size > MAX_FILE_BYTES:
                stats["skipped_too_large"].append(rel)
                continue
            raw = full.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats["skipped_not_utf8"].append(rel)
                continue
            text = text.replace("\r\n", "\n")
            if not text.strip():
                stats["skipped_empty"] += 1
                continue
            docs[split_of(rel)].append({"path": rel, "text": text})
    for s in SPLITS:
        docs[s].sort(key=lambda d: d["path"])
    return docs, stats


def corpus_sha256(docs: dict[str, list[dict]]) -> str:
    """sha256 over (split, path, text) of every file in canonical order."""
    h = hashlib.sha256()
    for s in SPLITS:
        for d in docs[s]:
            for part in (s, d["path"], d["text"]):
                b = part.encode("utf-8")
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
    return h.hexdigest()


def build(out_dir: Path = DEFAULT_OUT, force: bool = False) -> dict:
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists() and not force and all((out_dir / f"{s}.jsonl").exists() for s in SPLITS):
        manifest = json.loads(manifest_path.read_text())
        print(f"[corpus] exists: {out_dir} ({manifest['files']}), use --force to rebuild")
        return manifest
    docs, stats = collect()
    out_dir.mkdir(parents=True, exist_ok=True)
    for s in SPLITS:
        with open(out_dir / f"{s}.jsonl", "w", encoding="utf-8") as f:
            for d in docs[s]:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
    manifest = {
        "source": "Python standard library (*.py), PSF License",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_dir": str(stdlib_dir()),
        "excluded_components": sorted(EXCLUDED_COMPONENTS),
        "max_file_bytes": MAX_FILE_BYTES,
        "split_rule": f"int(sha1(relpath).hexdigest(), 16) % 100 < {HELDOUT_PERCENT} -> heldout",
        "files": {s: len(docs[s]) for s in SPLITS},
        "chars": {s: sum(len(d["text"]) for d in docs[s]) for s in SPLITS},
        "bytes": {s: sum(len(d["text"].encode("utf-8")) for d in docs[s]) for s in SPLITS},
        "skipped_too_large": stats["skipped_too_large"],
        "skipped_not_utf8": stats["skipped_not_utf8"],
        "skipped_empty": stats["skipped_empty"],
        "sha256": corpus_sha256(docs),
        "sha256_rule": "sha256 over split, path, text (each utf-8, prefixed by 8-byte LE length), splits train then heldout, paths sorted",
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"[corpus] wrote {out_dir}: files={manifest['files']} bytes={manifest['bytes']} sha256={manifest['sha256'][:16]}...")
    return manifest


# --------------------------------------------------------------------------- loading

_CACHE: dict[str, list[dict]] = {}


def load_corpus(split: str, corpus_dir: Path | str | None = None) -> list[dict]:
    """Returns [{"path", "text"}] for ``split`` ("train" or "heldout"), sorted by path.

    Reads ``data/default_pair/corpus/<split>.jsonl`` when present; otherwise collects
    the files straight from the running interpreter's stdlib (same result when the
    interpreter is the one that built the corpus).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    d = Path(corpus_dir) if corpus_dir is not None else DEFAULT_OUT
    key = f"{d}:{split}"
    if key not in _CACHE:
        path = d / f"{split}.jsonl"
        if path.exists():
            with open(path, encoding="utf-8") as f:
                _CACHE[key] = [json.loads(line) for line in f if line.strip()]
        else:
            _CACHE[key] = collect()[0][split]
    return _CACHE[key]


# --------------------------------------------------------------------------- prompts


def _prompt_records(doc: dict, context_lines: int, max_chars: int) -> Iterable[dict]:
    text = doc["text"]
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if not node.body:
            continue
        start = min([node.lineno] + [dec.lineno for dec in node.decorator_list])  # 1-based
        first_body = node.body[0]
        # End of the header = the line before the first body statement, unless the body
        # starts on the header line itself (``def f(): return 1``) -> skip those.
        if first_body.lineno <= node.lineno:
            continue
        header_end = first_body.lineno - 1  # 1-based, inclusive
        # Comments between header and body would be included; that is fine.
        end = header_end
        if (
            isinstance(first_body, ast.Expr)
            and isinstance(first_body.value, ast.Constant)
            and isinstance(first_body.value.value, str)
        ):
            end = first_body.lineno  # include the docstring's first line
        else:
            while end > node.lineno and not lines[end - 1].strip():
                end -= 1  # drop blank lines between the header and the body
        ctx_start = max(1, start - context_lines)
        prompt = "".join(lines[ctx_start - 1 : end]).rstrip("\r\n")
        if len(prompt) > max_chars or not prompt.strip():
            continue
        # The prompt must not already contain the whole body (e.g. a one-line class).
        if getattr(node, "end_lineno", None) is not None and node.end_lineno <= end:
            continue
        yield {
            "path": doc["path"],
            "lineno": node.lineno,
            "kind": "class" if isinstance(node, ast.ClassDef) else "def",
            "name": node.name,
            "prompt": prompt,
        }


def _prompts(split: str, n: int | None, context_lines: int, max_chars: int, with_meta: bool, seed: int):
    recs = []
    for doc in load_corpus(split):
        recs.extend(_prompt_records(doc, context_lines, max_chars))

    def key(r):
        s = f"{seed}:{r['path']}:{r['lineno']}".encode("utf-8")
        return hashlib.sha1(s).hexdigest()

    recs.sort(key=key)
    seen, out = set(), []
    for r in recs:
        if r["prompt"] in seen:
            continue
        seen.add(r["prompt"])
        out.append(r)
        if n is not None and len(out) >= n:
            break
    return out if with_meta else [r["prompt"] for r in out]


def heldout_prompts(n: int | None = 64, *, context_lines: int = 3, max_chars: int = 1200,
                    with_meta: bool = False, seed: int = 0):
    """Deterministic prompts (starts of functions/classes) from held-out files.

    Returns ``list[str]`` (or list of dicts with path/lineno/kind/name/prompt when
    ``with_meta``), in a fixed pseudo-random order (sha1 of seed:path:lineno), deduplicated.
    ``n=None`` returns all of them.
    """
    return _prompts("heldout", n, context_lines, max_chars, with_meta, seed)


def train_prompts(n: int | None = 1024, *, context_lines: int = 3, max_chars: int = 1200,
                  with_meta: bool = False, seed: int = 0):
    """Same as :func:`heldout_prompts` but from the train split (for drafter training)."""
    return _prompts("train", n, context_lines, max_chars, with_meta, seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="rebuild even if outputs exist")
    ap.add_argument("--show-prompts", type=int, default=0, help="print N held-out prompts")
    args = ap.parse_args(argv)
    build(args.out, force=args.force)
    if args.show_prompts:
        for p in heldout_prompts(args.show_prompts):
            print("-" * 60)
            print(p, end="")
    n_h = len(heldout_prompts(None))
    n_t = len(train_prompts(None))
    print(f"[corpus] prompts available: heldout={n_h} train={n_t}")


if __name__ == "__main__":
    sys.exit(main())
