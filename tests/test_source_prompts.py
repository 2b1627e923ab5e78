"""Out-of-domain prompt sets cut from installed packages' sources (`ood-code`, `ood-code-nl`, `source_contexts`)."""

from flashdraft.bench.datasets import dataset_label, load_prompts, source_contexts, source_prompts
from tiny import load_tokenizer


def test_source_prompts_end_where_asked_and_are_deterministic():
    mid, nl = source_prompts(12, end_at_line_start=False), source_prompts(12, end_at_line_start=True)
    assert len(mid) == len(nl) == 12
    assert all(not p.endswith("\n") and p.strip() for p in mid)
    assert all(p.endswith("\n") for p in nl)
    assert source_prompts(12, end_at_line_start=True) == nl and source_prompts(12, True, seed=1) != nl
    assert [p.text for p in load_prompts("ood-code-nl", 5)] == nl[:5]
    assert dataset_label("ood-code") == "ood-code"


def test_source_contexts_token_counts_and_endings():
    tok = load_tokenizer()
    plain = source_contexts(tok, 4, tokens=48)
    assert all(len(c) == 48 for c in plain)
    for c in source_contexts(tok, 4, tokens=48, end_at_line_start=True):
        assert tok.decode(c).endswith("\n") and len(c) <= 48
