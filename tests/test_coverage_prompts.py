"""Coverage prompts for drafter training (scripts/default_pair/coverage.py) and the contexts eval_tau.py cuts:
each ending is what its name says, lengths stay inside the target's window, the cut is deterministic, and only the
documents given are read; third-party code comes from installed packages other than the out-of-domain sets'."""

import random

import pytest
from transformers import AutoTokenizer

from flashdraft.loading import DEFAULT_TARGET
from scripts.default_pair.coverage import (ENDINGS, OUT_OF_DOMAIN_SOURCES, coverage_prompts, cut_context,
                                           package_documents)


@pytest.fixture(scope="module")
def tokenizer():
    if not (DEFAULT_TARGET / "tokenizer.json").is_file():
        pytest.skip("the default pair is not shipped in this checkout")
    return AutoTokenizer.from_pretrained(DEFAULT_TARGET)


DOC = "".join(f"def f{i}(x, y):\n    # add them\n    return x + y * {i}\n\n" for i in range(200))


@pytest.mark.parametrize("ending", ENDINGS)
def test_each_ending(tokenizer, ending):
    rng = random.Random(3)
    for tokens in (20, 64, 300):
        text = cut_context(DOC, tokenizer, tokens, ending, rng)
        assert text is not None
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= tokens + 4
        last_line = text.split("\n")[-1]
        if ending == "line-start":
            assert text.endswith("\n") and DOC.startswith(text)
        elif ending == "blank-lines":
            assert text.endswith("\n\n")
        elif ending == "comment":
            assert "#" in (last_line or text.rstrip("\n").split("\n")[-1])
        else:  # mid-line / mid-token: inside a line, ending in a visible character
            assert last_line.strip() and not text[-1].isspace() and DOC.startswith(text)
            if ending == "mid-token":
                line_in_doc = DOC[len(text) - len(last_line):].split("\n")[0]
                assert len(last_line) < len(line_in_doc)  # the cut falls inside the line


def test_coverage_prompts_mix_and_determinism(tokenizer):
    docs = [DOC, DOC.replace("add", "mul")]
    a = coverage_prompts(docs, tokenizer, 40, seed=1, chat_share=0.25)
    assert a == coverage_prompts(docs, tokenizer, 40, seed=1, chat_share=0.25)
    assert {r["ending"] for r in a} == set(ENDINGS)
    assert any("messages" in r for r in a) and any("prompt" in r for r in a)
    assert all(16 <= r["tokens"] <= 1900 for r in a)
    for r in a:
        text = r["messages"][0]["content"] if "messages" in r else r["prompt"]
        assert any("\n" + text[:len(text) // 2] in "\n" + d for d in docs)  # from the documents, at a line start


def test_foreign_code_is_sampled_per_package_and_never_from_the_out_of_domain_sources(monkeypatch, tmp_path):
    import importlib.util
    from types import SimpleNamespace

    for name, files in {"big": 30, "small": 3}.items():
        (tmp_path / name / "tests").mkdir(parents=True)
        (tmp_path / name / "tests" / "test_x.py").write_text("# a test file\n")
        for i in range(files):
            (tmp_path / name / f"m{i:02d}.py").write_text(f"# {name} {i}\n")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(
        submodule_search_locations=[str(tmp_path / name)] if (tmp_path / name).is_dir() else None))
    docs = package_documents(("big", "small", "absent"), per_package=10)
    assert len(docs) == 13 and sum(d.startswith("# small") for d in docs) == 3  # 10 of big's 30, all of small's
    assert not any("a test file" in d for d in docs)
    assert docs == package_documents(("big", "small", "absent"), per_package=10)  # deterministic
    for name in OUT_OF_DOMAIN_SOURCES[:2]:
        with pytest.raises(ValueError, match="out-of-domain"):
            package_documents(("big", name))
    with pytest.raises(ValueError, match="installed"):
        package_documents(("absent",))
