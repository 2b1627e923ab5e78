"""Documentation references resolve: code, tests, scripts and the READMEs point to sections of docs/design.md
(written `docs/design.md, '<section title>'`), every such title is a heading there, and nothing points to a design
file that users do not have."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SCANNED = [ROOT / "flashdraft", ROOT / "tests", ROOT / "scripts", ROOT / "docs", ROOT / "README.md",
           ROOT / "BENCHMARKS.md"]
MISSING_DOC = ("dflash" + ".md").encode()  # spelled apart so that this file does not match itself
REFERENCE = re.compile(r"docs/design\.md,\s*'([^'<\n][^'\n]*)'")  # '<section title>' is the placeholder


def scanned_files() -> list[Path]:
    files = []
    for top in SCANNED:
        if top.is_file():
            files.append(top)
        elif top.is_dir():
            files += [p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                      and p.suffix not in (".safetensors", ".png", ".pyc")]
    return sorted(files)


def headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", DESIGN.read_text(), re.M)}


def references() -> dict[str, list[str]]:
    """section title -> files that reference it."""
    found: dict[str, list[str]] = {}
    for path in scanned_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for m in REFERENCE.finditer(text):
            found.setdefault(m.group(1), []).append(str(path.relative_to(ROOT)))
    return found


def test_no_reference_to_a_design_file_users_do_not_have():
    offenders = [str(p.relative_to(ROOT)) for p in scanned_files() if MISSING_DOC in p.read_bytes().lower()]
    assert offenders == [], f"these files mention a design document that is not shipped: {offenders}"


def test_every_referenced_design_section_exists():
    assert DESIGN.is_file()
    refs = references()
    assert sum(map(len, refs.values())) >= 12, f"expected the code to point to docs/design.md; found {refs}"
    missing = {title: files for title, files in refs.items() if title not in headings()}
    assert missing == {}, f"referenced sections that are not headings of docs/design.md: {missing}"
    # the sections the code relies on are all there
    for title in ("Decode cycle", "Drafter architecture", "Checkpoint format", "Training", "Verification",
                  "Benchmark conventions"):
        assert title in headings()


def test_train_help_points_to_the_design_doc():
    from flashdraft.train.cli import add_train_parser

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_train_parser(parser.add_subparsers())
    text = parser._subparsers._group_actions[0].choices["train"].format_help()
    assert REFERENCE.search(text) and REFERENCE.search(text).group(1) in headings()
    assert MISSING_DOC not in text.lower().encode()
