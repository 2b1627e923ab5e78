"""Prompt lookup beside the drafter: a row's chain of drafts continued by what followed the latest earlier match of
its context's last tokens, where the two agree.

A target repeats itself: code repeats identifiers and whole lines, and a small model falls into loops
(`_CullFile, _CullFile, ...`). A block-diffusion drafter conditioned on the target's features often drafts the
first token of such a repeat and then loses it (on the shipped pair, out-of-domain prompts whose answers loop
accept 1-2 tokens per cycle). The copy costs no model call: `NgramIndex` keeps, per row, where each n-gram of its
tokens last ended (updated as tokens are committed, O(1) per token), and `continuation` returns the tokens that
followed the best earlier match of the context's last n tokens (n >= min_ngram; the longest match, up to
`MAX_NGRAM`, among the last `RECENT` occurrences; the latest of equals). The engine splices that continuation into
a drafting row's chain when its first token is the drafter's own first draft (`splice`): the drafter vouches for
the start of the repeat, the copy supplies the rest. Rows the draft policy leaves at one-token steps (the drafter
failing there) verify the continuation alone where the policy's price for it pays (`lookup_steps`): a loop the
drafter keeps missing is copied without it. The verifier is unchanged (drafts only steer acceptance).

What this module does not know about: drafters, tensors, the verifier, token trees (their lookup branch is
`tree.lookup_continuation`).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 8  # the longest match measured when choosing among occurrences
RECENT = 4  # occurrences of an n-gram remembered (the latest ones)


class NgramIndex:
    """One row's tokens (prompt, then output as it grows) and where each `min_ngram`-gram of them last ended."""

    def __init__(self, min_ngram: int):
        if min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
        self.n = min_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its last RECENT end positions, oldest first
        self.indexed = 0  # end positions < this are in `ends`

    def extend(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Catch up with the row's tokens: prompt + output (both only ever grow while the row runs)."""
        have = len(self.tokens)
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            have = len(prompt)
        self.tokens.extend(output[have - len(prompt):])

    def continuation(self, length: int, min_match: int = 0) -> list[int]:
        """Up to `length` tokens that followed the best earlier match of the last n >= max(min_ngram, min_match)
        tokens ([] if they never occurred before)."""
        h, n = self.tokens, self.n
        last = len(h) - 1
        # index the n-grams ending before the last token: an occurrence must leave a token to continue with
        for end in range(max(self.indexed, n - 1), last):
            seen = self.ends.setdefault(tuple(h[end - n + 1:end + 1]), [])
            seen.append(end)
            if len(seen) > RECENT:
                del seen[0]
        self.indexed = max(self.indexed, last)
        if last < n:
            return []
        best_end, best_length = None, 0
        for end in reversed(self.ends.get(tuple(h[last - n + 1:]), ())):
            matched = n
            while matched < MAX_NGRAM and end - matched >= 0 and h[end - matched] == h[last - matched]:
                matched += 1
            if matched > best_length:
                best_end, best_length = end, matched
        return [] if best_end is None or best_length < min_match else h[best_end + 1:best_end + 1 + length]


def splice(drafts: list[int], copy: list[int]) -> list[int] | None:
    """The chain with `copy` in place of its drafts, when the copy starts with the drafter's first draft and then
    differs from it (None: nothing to splice)."""
    if not copy or not drafts or copy[0] != drafts[0]:
        return None
    spliced = copy[:len(drafts)] + drafts[len(copy):]
    return spliced if spliced != drafts else None
