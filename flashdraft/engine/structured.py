"""Structured output: the committed text follows a grammar (a JSON schema, any JSON object, a regex, one of a list
of strings, or a Lark grammar), through llguidance's token masks.

A constraint is one more logit processor (`generate._process_logits`, after penalties and the logit bias): at each
position the target's logits keep the tokens the grammar allows after the text before that position and lose the
rest (-inf). What is sampled or argmaxed is then the constrained target's distribution, the same one a one-token
loop masking each step would sample (transformers' `generate` with such a processor is the tests' reference).

In a verified block, position t follows the output and drafts 1..t, so its mask is the grammar's after those drafts:
the matcher walks the drafts, taking a mask at each position, and rolls back. A draft the grammar refuses ends the
walk: the target gives it no probability, the verifier rejects it, and no later position of the row can be reached,
so those positions keep their logits unmasked (no row of -inf for a softmax to turn into NaN). Committed tokens then
advance the matcher for good (`RowGrammar.consume`). Drafting methods know nothing of the grammar; where one leaves
its logits (DFlash, eager), the engine walks its drafts through the grammar before the verify (`RowGrammar.constrain`:
a refused draft becomes the best allowed token by those logits, and the walk's masks serve the verify). Drafts only
steer acceptance: a refused one costs acceptance, never correctness.

When the grammar is complete the mask allows only the end-of-sequence ids; a row that commits one of them ends even
if its request does not stop at EOS (nothing can follow). A grammar with no allowed token at some position (a dead
end llguidance cannot rule out in advance) allows EOS there too, so a row ends rather than sampling from nothing.

What this module does not know about: block layout, verification, sampling, HTTP (the server maps OpenAI's
`response_format` and vLLM's `structured_outputs` onto `StructuredOutput`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json_schema` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object),
    `regex` (the whole output matches it; Rust regex syntax), `choice` (the output is one of these strings),
    `grammar` (a Lark grammar, llguidance's dialect). `any_whitespace=False` makes JSON compact, separators ", " and
    ": " and no other whitespace (vLLM's `disable_any_whitespace`): a small model given any whitespace can spend its
    tokens on it."""

    json_schema: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: str | None = None
    any_whitespace: bool = True

    def __post_init__(self):
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if schema is not None:
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
            # kept as canonical JSON text: the params stay hashable and equal schemas compare equal
            object.__setattr__(self, "json_schema", json.dumps(schema, sort_keys=True))
        choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice or ())
        if any(not isinstance(c, str) or not c for c in choice):
            raise ValueError("choice must be non-empty strings")
        object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        given = [k for k in KINDS if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"a structured output takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k))

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (validated against a tokenizer by `GrammarCompiler`)."""
        from llguidance import LLMatcher

        compact = None if self.any_whitespace else COMPACT_JSON
        if self.json_schema is not None:
            return LLMatcher.grammar_from_json_schema(self.json_schema, overrides=compact)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice:  # Lark string literals take JSON's escapes: any string is one literal
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


COMPILED_GRAMMARS = 64  # compiled constraints a compiler keeps (least recently used out)


class GrammarCompiler:
    """One engine's llguidance tokenizer (built once, at the first structured request: ~0.1 s at 8k tokens, ~1 s at
    150k) and the matchers of its requests. Refuses, with llguidance's message, a constraint it cannot compile.

    Compiled constraints are kept (the last `COMPILED_GRAMMARS`, by `StructuredOutput`, which compares equal for
    equal schemas) and each request's matcher is a copy of one (~10-100 us against 1-10 ms to compile): the server
    compiles while it validates a request, on a worker thread, so the scheduler thread that runs every row's cycle
    does not (a request's n choices, and clients that send the same schema or tools again, share one compile)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # the server's event loop validates while its scheduler thread compiles
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()  # spec -> its pristine LLMatcher
        self._compiled_lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                try:
                    import llguidance.hf
                except ImportError as e:  # a dependency: only a broken install lands here
                    raise ValueError(f"structured output needs llguidance ({e})") from None
                from transformers import PreTrainedTokenizerFast

                if not isinstance(self.hf_tokenizer, PreTrainedTokenizerFast):
                    raise ValueError("structured output needs a fast (tokenizers-backed) tokenizer, got "
                                     f"{type(self.hf_tokenizer).__name__}")
                if not self.eos_ids:
                    raise ValueError("structured output needs an end-of-sequence token: the tokenizer and the "
                                     "target's generation config name none")
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_ids)
            return self._tokenizer

    def check(self, spec: StructuredOutput) -> None:
        """ValueError naming what is wrong with `spec` if it cannot compile for this tokenizer; compiled and kept
        otherwise."""
        self._compile(spec)

    def matcher(self, spec: StructuredOutput) -> "RowGrammar":
        """A fresh place in `spec`'s grammar, for one request."""
        return RowGrammar(self._compile(spec).deep_copy(), self.vocab_size, self.eos_ids)

    def _compile(self, spec: StructuredOutput):
        with self._compiled_lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        from llguidance import LLMatcher

        try:
            grammar = spec.llguidance_grammar()
        except ValueError as e:
            raise ValueError(f"{spec.kind}: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer())
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{spec.kind} cannot be compiled: {error.strip().splitlines()[0]}")
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{spec.kind} cannot be compiled: {matcher.get_error()}")
        with self._compiled_lock:  # (two threads compiling the same spec at once keep the later: equal matchers)
            self._compiled[spec] = matcher
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher


class RowGrammar:
    """One request's place in its grammar: masks for the positions of a block, and the committed tokens."""

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int]):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self.ended = False  # an end-of-sequence token was committed
        self._walked: tuple[list[int], np.ndarray] | None = None  # `constrain`'s drafts and masks until the next commit

    def _allowed(self) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = bits[:self.vocab_size].astype(bool)
        if not allowed.any():  # a dead end: end the row instead of sampling from nothing
            allowed[self.eos_ids] = True
        return allowed

    def masks(self, drafts: list[int], width: int) -> torch.Tensor:
        """Allowed tokens [width, V] (bool) at block positions 0 .. width - 1, position t after drafts[:t]; rows
        past the first draft the grammar refuses allow everything (unreachable, see the module docstring)."""
        if self._walked is not None:  # the drafts `constrain` walked, or a prefix of them
            walked, masks = self._walked
            if width <= len(masks) and list(drafts[:width - 1]) == walked[:width - 1]:
                return torch.from_numpy(masks[:width])
        return torch.from_numpy(self._walk(drafts, width)[1])

    def constrain(self, drafts: list[int], scores: torch.Tensor) -> list[int]:
        """Drafts [k] walked through the grammar: each refused one (and the walk goes on from it) becomes its
        position's best allowed token by `scores` [k, V] (the drafter's logits, for sampled rows its race's log q - log
        E), so every draft the grammar allows is one the target can accept. The walk's masks are kept for `masks`,
        which the verify of these drafts asks for next."""
        out, allowed, reached = self._walk(drafts, len(drafts) + 1, scores)
        self._walked = (out[:reached], allowed[:reached + 1])
        return out

    def _walk(self, drafts: list[int], width: int, scores: torch.Tensor | None = None):
        """(drafts, allowed tokens [width, V] at positions 0 .. width - 1, the last position reached): the matcher
        walks the drafts, taking each position's mask, then rolls back. A refused draft ends the walk, or with
        `scores` becomes its position's best allowed token; past an end-of-sequence draft nothing is committed, so
        the walk ends there too."""
        out = list(drafts)
        allowed = np.ones((width, self.vocab_size), dtype=bool)
        walked = 0
        for t in range(width):
            allowed[t] = self._allowed()
            if t == width - 1:
                break
            if not allowed[t, out[t]]:
                if scores is None:
                    break
                best = scores[t].float().masked_fill(~torch.from_numpy(allowed[t]).to(scores.device), float("-inf"))
                out[t] = int(best.argmax())
                if not allowed[t, out[t]]:  # the drafter puts no finite score on an allowed token
                    out[t] = int(np.flatnonzero(allowed[t])[0])
            if out[t] in self.eos_ids or not self.matcher.consume_token(out[t]):
                break
            walked += 1
        if walked:
            self.matcher.rollback(walked)
        return out, allowed, t

    def consume(self, token: int) -> None:
        """A committed token (one the masks allowed). An end-of-sequence id ends the row."""
        self._walked = None
        if token in self.eos_ids:
            self.ended = True
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused committed token {token}: {self.matcher.get_error()}")


class GrammarLogitsProcessor:
    """A transformers `generate` logits processor (batch 1) masking each step as the engine does: the constrained
    target's own one-token-at-a-time decoding, which `--compare` and the benchmarks check the engine against."""

    def __init__(self, grammar: RowGrammar, prompt_len: int):
        self.grammar, self.prompt_len, self.seen = grammar, prompt_len, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len:].tolist()
        for t in generated[self.seen:]:
            self.grammar.consume(t)
        self.seen = len(generated)
        return scores.masked_fill(~self.grammar.masks([], 1).to(scores.device), float("-inf"))
