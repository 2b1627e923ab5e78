"""Incremental detokenization for streaming: the text of a growing output, stop strings, and the deltas to send.

Each update decodes only the tokens added since the last one plus a short lookback (the prefix-offset / read-offset
scheme of transformers' TextStreamer and vLLM's `detokenize_incrementally`): with `prefix` = the text of the
lookback tokens, the new text is `decode(lookback + new)[len(prefix):]`. Text is committed only up to a token
boundary that ends on a whole character; while the new text ends in "\ufffd" (a UTF-8 character split across
tokens) the tokens past the last such boundary are decoded again on the next update, and flushed as they are when
the output is final. Stop strings are searched only in the new text plus (longest stop string - 1) characters
before it: an earlier occurrence would have been found by an earlier update. So the work per update is bounded by
the new tokens (plus the lookback and a split character), not by the length of the output.

The results (final text, where a stop string cuts it and the tokens kept, streamed deltas) are those of decoding
the whole output at once with `decode(tokens, skip_special_tokens=...)` (True unless a request says otherwise), for
tokenizers whose decode concatenates at whole-character token boundaries: byte-level BPE (GPT-2, Llama 3, Qwen,
this project's own tokenizer) and SentencePiece ones (whose dropped leading space the lookback covers); as in vLLM,
not tokenizers whose `clean_up_tokenization_spaces` rewrites text across a boundary.

`bad_word_ids` reads vLLM's `bad_words` (text) into the token sequences `SamplingParams.bad_words` bans.

What this module does not know about: the engine, sampling, stop token ids; it sees a growing token list.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable

LOOKBACK = 4  # tokens decoded again before the new ones (at least; from the latest boundary that far back)
REPLACEMENT = "\ufffd"  # what a decode shows for an incomplete UTF-8 character at its end


class IncrementalText:
    """The decoded text of one request's output, updated as tokens are appended (see the module docstring).

    detok = IncrementalText(tokenizer, stop_strings)
    keep = detok.update(tokens, final)   # None, or how many tokens to keep: a stop string ended the text
    delta = detok.delta(finished)        # the text that became final since the last delta
    detok.text                           # the whole text (O(length): once, at the end)
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = (), include_stop: bool = False,
                 hold_stops: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode = text_decoder(tokenizer, skip_special_tokens)
        self.stops = tuple(stop_strings)
        self.overlap = max(map(len, self.stops)) - 1 if self.stops else 0  # a stop string may start this far back
        self.include_stop = include_stop
        self.pieces: list[str] = []  # committed text, one piece per update that advanced the boundary
        self.mark_tokens = [0]  # token count at each boundary (the text there ends on a whole character)
        self.mark_chars = [0]  # text length at each boundary
        self.tail = ""  # text of the tokens past the last boundary (may end in an incomplete character)
        self.seen = 0  # tokens at the last update (boundaries up to there were judged already)
        self.searched = 0  # characters of the text searched for stop strings (all of them final)
        self.emitted = 0  # characters handed out by `delta`
        self.recent = ""  # committed text from character `recent_start` on: what deltas and the overlap need
        self.recent_start = 0
        self.final_text: str | None = None  # set once the output is final (or a stop string cut it)
        # held (a request's min_tokens): no stop string is looked for (and the text kept for it) until
        # `search_from` says where to begin
        self.holding_stops = hold_stops and bool(self.stops)

    @property
    def committed(self) -> int:
        return self.mark_chars[-1]

    @property
    def text(self) -> str:
        if self.final_text is not None:
            return self.final_text
        return "".join(self.pieces) + self.tail

    def update(self, tokens: list[int], final: bool) -> int | None:
        """Take in the tokens appended since the last call (`tokens` is the whole output so far). Returns None,
        or the number of tokens to keep when a stop string ended the text (the text is then cut and final)."""
        if self.final_text is not None:
            raise RuntimeError("IncrementalText.update after the text was final")
        read = self.mark_tokens[-1]
        if len(tokens) > read:
            start = self._lookback(read)
            prefix = self._decode(tokens[start:read])
            tail = self._decode(tokens[start:])[len(prefix):]
            if final or _clean(tail):
                self._commit(tail, len(tokens))
                tail = ""
            else:  # the last boundary among the new tokens that ends on a whole character, if any
                for q in range(len(tokens) - 1, max(read, self.seen), -1):
                    piece = self._decode(tokens[start:q])[len(prefix):]
                    if _clean(piece) and tail.startswith(piece):
                        self._commit(piece, q)
                        tail = tail[len(piece):]
                        break
            self.tail = tail
        self.seen = len(tokens)
        visible = self.tail if final else self.tail.rstrip(REPLACEMENT)
        end = self.committed + len(visible)
        if self.stops and not self.holding_stops and end > self.searched:
            base = max(0, self.searched - self.overlap)
            haystack = self.recent[base - self.recent_start:] + visible
            hits = [(haystack.find(s), s) for s in self.stops]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                pos += base
                keep = self._tokens_reaching(tokens, pos + len(s))
                self.final_text = self.text[:pos + (len(s) if self.include_stop else 0)]
                return keep
            self.searched = end
        if final:
            self.final_text = self.text
        # keep only the committed text that a delta or the stop-string overlap may still need
        start = min(self.emitted, max(0, self.searched - self.overlap), self.committed)
        if start > self.recent_start:
            self.recent = self.recent[start - self.recent_start:]
            self.recent_start = start
        return None

    def search_from(self, chars: int) -> None:
        """Look for stop strings that end past character `chars` from now on (vLLM's min_tokens: not in the text of
        the first min_tokens tokens; one that straddles its end counts)."""
        self.holding_stops = False
        self.searched = chars

    def delta(self, finished: bool) -> str:
        """The text that became final since the last call: all of it once finished; before, the text up to an
        incomplete character, less the last (longest stop string - 1) characters (they may start a stop string)."""
        if finished:
            text = self.text
            out, self.emitted = text[self.emitted:], max(self.emitted, len(text))
            return out
        end = self.committed + len(self.tail.rstrip(REPLACEMENT))
        if self.stops:  # a stop string not found yet ends past `end`, so it starts at end - overlap or later
            end -= self.overlap
        if end <= self.emitted:
            return ""
        out = (self.recent + self.tail)[self.emitted - self.recent_start:end - self.recent_start]
        self.emitted = end
        return out

    # ---- internals ------------------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids) if ids else ""

    def _lookback(self, n: int) -> int:
        """The latest boundary at least LOOKBACK tokens before token n (0 if none)."""
        return self.mark_tokens[max(0, bisect_right(self.mark_tokens, n - LOOKBACK) - 1)]

    def _commit(self, piece: str, n_tokens: int) -> None:
        if not piece:
            return  # nothing to show yet (e.g. skipped special tokens): the boundary stays where it is
        self.pieces.append(piece)
        self.mark_tokens.append(n_tokens)
        self.mark_chars.append(self.committed + len(piece))
        self.recent += piece

    def _tokens_reaching(self, tokens: list[int], need: int) -> int:
        """The fewest tokens whose decoded text holds the first `need` characters of the text (a stop string's
        end): bisect the boundaries, then decode token by token within the one piece that holds that character."""
        if need <= self.committed:
            k = bisect_left(self.mark_chars, need)  # mark_chars[k] >= need > mark_chars[k - 1]
            lo, hi = self.mark_tokens[k - 1], self.mark_tokens[k]
            lo_chars, segment = self.mark_chars[k - 1], self.pieces[k - 1]
        else:
            lo, hi, lo_chars, segment = self.mark_tokens[-1], len(tokens), self.committed, self.tail
        want = segment[:need - lo_chars]
        start = self._lookback(lo)
        prefix = self._decode(tokens[start:lo])
        for n in range(lo + 1, hi):
            if self._decode(tokens[start:n])[len(prefix):].startswith(want):
                return n
        return hi


def text_decoder(tokenizer, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)`, called on the tokenizer's Rust backend directly where that is
    all transformers' decode does (its own `decode` and `_decode` on a fast tokenizer that does not clean up
    tokenization spaces): an output fed one token at a time took 13.5 us per token through transformers' wrapper
    and 5.9 us through the backend (the shipped tokenizer), for every row of every cycle."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and backend is not None
            and kind.decode is PreTrainedTokenizerBase.decode and kind._decode is TokenizersBackend._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _clean(text: str) -> bool:
    """Text that ends on a whole character (and says something)."""
    return bool(text) and not text.endswith(REPLACEMENT)


def bad_word_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of `bad_words`: each word (leading spaces stripped) as written, and after a space where that is
    another token sequence of the same length (the word inside the text rather than at its start). A word that is no
    tokens is a ValueError."""
    out = []
    for word in words:
        ids = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not ids:
            raise ValueError(f"bad word {word!r} is no tokens")
        out.append(ids)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(ids) and spaced[0] != ids[0]:
            out.append(spaced)
    return tuple(out)
