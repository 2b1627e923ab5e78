"""Structured output (`SamplingParams.structured`, the server's `response_format` / `structured_outputs`): the output
is the constrained target's own.

Greedy rows are compared with transformers' `generate` under a logits processor that masks each step to the
tokens llguidance allows after the text so far (one token at a time, no blocks, no drafts); seeded sampled rows with
the constrained target's race under the request's noise, computed here without an engine; the distribution over a
choice's strings with the constrained target's own probabilities of them (chi-square). Through drafting of every
acceptance length (an oracle drafter), the DFlash drafter and plain decoding, beside unconstrained rows, on both
target paths and on the shipped pair.
"""

from __future__ import annotations

import json

import llguidance.hf
import numpy as np
import pytest
import torch
from llguidance import LLMatcher
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from flashdraft import SamplingParams, SpecEngine, StructuredOutput
from flashdraft.engine.noise import exponential_noise, race
from flashdraft.loading import load_pair
from tiny import engine_with, save_text_pair

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "size", "ok"], "additionalProperties": False}
SPECS = {"schema": StructuredOutput(json_schema=SCHEMA), "object": StructuredOutput(json_object=True),
         "regex": StructuredOutput(regex=r"[a-z_]+\([a-z, ]*\)"),
         "choice": StructuredOutput(choice=("True", "False", "None")),
         "grammar": StructuredOutput(grammar='start: "x = " NUM\nNUM: /[0-9]{1,4}/')}


def allowed_ids(matcher, vocab: int) -> torch.Tensor:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab].astype(bool))


class GrammarMask(LogitsProcessor):
    """The reference: each step's scores keep the tokens the grammar allows after the tokens generated so far."""

    def __init__(self, tokenizer, spec: StructuredOutput, prompt_len: int, vocab: int, eos: list[int]):
        self.matcher = LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos),
                                 spec.llguidance_grammar())
        self.start, self.vocab = prompt_len, vocab

    def __call__(self, input_ids, scores):
        last = input_ids[0, -1].item()
        if input_ids.shape[1] > self.start:
            assert self.matcher.consume_token(last)
        return scores.masked_fill(~allowed_ids(self.matcher, self.vocab), float("-inf"))


@torch.inference_mode()
def constrained_generate(model, tokenizer, prompt, spec, max_new, eos) -> list[int]:
    ids = torch.tensor([prompt])
    processors = LogitsProcessorList([GrammarMask(tokenizer, spec, len(prompt), model.config.vocab_size, eos)]
                                     if spec else [])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0], logits_processor=processors)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    """A tiny random Qwen3 with the project's tokenizer (8192 tokens; its lm_head sharpened so greedy is not
    near-ties), float32, and the tokenizer."""
    root = tmp_path_factory.mktemp("structured_pair")
    tok, _ = save_text_pair(root, lm_head_scale=8.0)
    return AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float64).eval(), tok


@pytest.fixture(scope="module")
def shipped():
    return load_pair(device="cpu", dtype="float32")


PROMPTS = ["def build(dtype, device):\n", "# the settings as JSON\nconfig = ", "x"]


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("proposer", ["oracle", "none"])
def test_greedy_structured_output_is_the_constrained_targets_own(text_pair, fast_path, proposer):
    model, tok = text_pair
    eos, max_new = [tok.eos_token_id], 24
    prompts = [tok.encode(p) for p in PROMPTS]
    specs = [SPECS["schema"], None, SPECS["regex"]]
    expected = [constrained_generate(model, tok, p, s, max_new, eos) for p, s in zip(prompts, specs)]
    assert expected[0] != constrained_generate(model, tok, prompts[0], None, max_new, eos)  # the grammar acts
    # oracle: the constrained output as drafts, corrupted: every acceptance length, refused drafts
    engine = engine_with(proposer, model, prompts, expected, fast_path, tokenizer=tok, seed=4)
    params = [SamplingParams(max_new_tokens=max_new, stop_token_ids=tuple(eos), structured=s) for s in specs]
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    if proposer == "oracle":
        assert all(r.stats.num_drafts for r in results)


@pytest.mark.parametrize("kind", list(SPECS))
def test_shipped_pair_structured_output_equals_generate_and_parses(shipped, kind):
    model, tok, drafter = shipped
    engine = SpecEngine(model, drafter, tok, draft_policy="fixed")
    eos, spec = engine.eos_token_ids, SPECS[kind]
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=64, stop_token_ids=tuple(eos), structured=spec))
    for prompt, r in zip(prompts, results):
        assert r.token_ids == constrained_generate(model, tok, prompt, spec, 64, eos)
        assert r.stats.num_drafts > 0
        if r.finish_reason == "stop":
            check = LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos),
                              spec.llguidance_grammar())
            assert check.consume_tokens(r.token_ids[:-1]) and check.is_accepting()
            if kind == "schema":
                value = json.loads(r.text)
                assert set(value) == {"name", "size", "ok"} and isinstance(value["ok"], bool)
            if kind == "choice":
                assert r.text in spec.choice


def test_seeded_sampling_is_the_constrained_targets_race(shipped):
    model, tok, drafter = shipped
    prompt, spec = tok.encode(PROMPTS[1]), SPECS["schema"]
    eos = [tok.eos_token_id]
    q = SamplingParams(max_new_tokens=24, temperature=0.9, seed=11, stop_token_ids=tuple(eos), structured=spec)
    mask = GrammarMask(tok, spec, len(prompt), len(tok), eos)
    ids, expected = list(prompt), []
    with torch.inference_mode():
        for j in range(q.max_new_tokens):
            logits = mask(torch.tensor([ids]), model(torch.tensor([ids])).logits[:, -1].float())[0]
            noise = exponential_noise(torch.tensor([q.seed]), torch.tensor([j]), 1, logits.shape[-1])[0, 0]
            expected.append(int(race(torch.softmax(logits / q.temperature, dim=-1), noise)))
            ids.append(expected[-1])
            if expected[-1] in eos:
                break
    for engine in (SpecEngine(model, None, tok), SpecEngine(model, drafter, tok, draft_policy="fixed")):
        got = engine.generate([prompt, prompt], [q, SamplingParams(max_new_tokens=24, temperature=0.9, seed=3)])
        assert got[0].token_ids == expected


@torch.inference_mode()
def choice_probabilities(model, tok, prompt, spec, eos) -> dict[str, float]:
    """P(output = each choice) under the constrained target at temperature 1: the sum over every tokenization the
    grammar allows of the product of the masked softmax along it (walked with llguidance's matcher)."""
    matcher = LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos), spec.llguidance_grammar())
    probs: dict[str, float] = {}

    def walk(tokens: list[int], p: float):
        logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double()
        allowed = allowed_ids(matcher, len(tok))
        dist = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        for t in torch.nonzero(allowed)[:, 0].tolist():
            if t in eos:
                text = tok.decode(tokens)
                probs[text] = probs.get(text, 0.0) + p * dist[t].item()
            else:
                assert matcher.consume_token(t)
                walk(tokens + [t], p * dist[t].item())
                matcher.rollback(1)

    walk([], 1.0)
    return probs


def test_sampled_choices_follow_the_constrained_targets_distribution(shipped):
    model, tok, drafter = shipped
    spec = StructuredOutput(choice=("True", "False", "None", "self"))
    prompt, eos = tok.encode("    return "), [tok.eos_token_id]
    probs = choice_probabilities(model, tok, prompt, spec, eos)
    assert set(probs) == set(spec.choice) and sum(probs.values()) == pytest.approx(1.0, abs=1e-6)
    n = 600
    engine = SpecEngine(model, drafter, tok, draft_policy="fixed")
    results = engine.generate([prompt] * n, [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s,
                                                            stop_token_ids=tuple(eos), structured=spec)
                                             for s in range(n)])
    counts = {c: 0 for c in spec.choice}
    for r in results:
        counts[r.text] += 1
    observed = [counts[c] for c in spec.choice]
    expected = [n * probs[c] for c in spec.choice]
    assert min(expected) > 5, expected  # each choice is sampled often enough for the test to see it
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


def test_log_probabilities_under_a_grammar_name_allowed_tokens_only(shipped):
    model, tok, drafter = shipped
    spec = SPECS["choice"]
    r = SpecEngine(model, drafter, tok).generate(
        [tok.encode("    return ")], SamplingParams(max_new_tokens=8, logprobs=5, structured=spec,
                                                   stop_token_ids=(tok.eos_token_id,)))[0]
    for entry in r.logprobs:
        assert np.isfinite(entry.logprob) and entry.top and all(np.isfinite(v) for _, v in entry.top)
    # the first token's alternatives are the first tokens of the choices, nothing else
    firsts = {t for t, _ in r.logprobs[0].top}
    assert all(any(c.startswith(tok.decode([t])) for c in spec.choice) for t in firsts)


def test_bad_constraints_are_refused(text_pair):
    model, tok = text_pair
    engine = SpecEngine(model, None, tok)
    for bad, match in ((StructuredOutput(regex="("), "regex cannot be compiled"),
                       (StructuredOutput(json_schema={"type": "objec"}), "json_schema cannot be compiled"),
                       (StructuredOutput(grammar="start: nothing_here"), "grammar cannot be compiled")):
        with pytest.raises(ValueError, match=match):
            engine.generate([[5, 6]], SamplingParams(structured=bad))
    for kwargs, match in (({}, "exactly one"), ({"regex": "a", "choice": ("b",)}, "exactly one"),
                          ({"json_schema": "{not json"}, "not valid JSON"), ({"json_schema": [1]}, "JSON object"),
                          ({"choice": ("a", "")}, "non-empty")):
        with pytest.raises(ValueError, match=match):
            StructuredOutput(**kwargs)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        SpecEngine(model).generate([[5, 6]], SamplingParams(structured=SPECS["regex"]))


def test_compiled_grammars_are_kept_and_each_request_gets_its_own_copy(text_pair, monkeypatch):
    """A spec compiles once (equal schemas given as a dict and as text count as one); each matcher is an
    independent copy: one row's committed tokens leave the next row's start, and every copy walks as a freshly
    compiled llguidance matcher does; the least recently used compile leaves past the limit."""
    from flashdraft.engine import structured

    model, tok = text_pair
    compiler = SpecEngine(model, None, tok).grammars
    eos = compiler.eos_ids
    compiles = []
    real = structured.StructuredOutput.llguidance_grammar
    monkeypatch.setattr(structured.StructuredOutput, "llguidance_grammar",
                        lambda spec: compiles.append(spec.kind) or real(spec))
    schema = json.loads(SPECS["schema"].json_schema)
    first = compiler.matcher(StructuredOutput(json_schema=schema))
    compiler.check(StructuredOutput(json_schema=json.dumps(schema, indent=1)))
    second = compiler.matcher(SPECS["schema"])
    assert compiles == ["json_schema"]
    text = tok.encode('{"name": "ab"')
    reference = LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos), real(SPECS["schema"]))
    for t in text:
        first.consume(t)  # one request's tokens ...
        assert reference.consume_token(t)
    assert torch.equal(second.masks([], 1)[0], allowed_ids(compiler.matcher(SPECS["schema"]).matcher, len(tok)))
    start = LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos), real(SPECS["schema"]))
    assert torch.equal(second.masks([], 1)[0], allowed_ids(start, len(tok)))  # ... leave another's start alone
    assert torch.equal(first.masks([], 1)[0], allowed_ids(reference, len(tok)))
    monkeypatch.setattr(structured, "COMPILED_GRAMMARS", 2)
    compiler.matcher(SPECS["regex"])
    compiler.matcher(SPECS["schema"])  # used again: the regex is now the oldest
    compiler.matcher(SPECS["choice"])
    compiler.matcher(SPECS["schema"])
    compiler.matcher(SPECS["regex"])
    assert compiles == ["json_schema", "regex", "choice", "regex"]


def test_constrained_drafts_are_allowed_and_keep_the_walks_masks(text_pair):
    """`RowGrammar.constrain` moves each refused draft to its position's best allowed token (the walk going on from
    it), and the masks it keeps for the verify are the ones a fresh walk over its drafts computes."""
    model, tok = text_pair
    engine = SpecEngine(model, None, tok)
    gen = torch.Generator().manual_seed(0)
    for spec in (SPECS["schema"], SPECS["regex"], SPECS["grammar"]):
        grammar = engine.grammars.matcher(spec)
        fresh = engine.grammars.matcher(spec)
        for _ in range(3):
            scores = torch.randn(7, len(tok), generator=gen)
            drafts = torch.randint(0, len(tok), (7,), generator=gen).tolist()
            out = grammar.constrain(drafts, scores)
            masks = fresh.masks(out, 8)
            for t, token in enumerate(out):
                if token in engine.eos_token_ids:
                    break
                assert masks[t, token]  # allowed after the drafts before it
                if drafts[t] != token:  # moved: the best allowed by the scores
                    assert token == int(scores[t].masked_fill(~masks[t], float("-inf")).argmax())
            assert torch.equal(grammar.masks(out, 8), masks)
            other = drafts[:1] + out[1:] if drafts[0] != out[0] else [out[0] + 1] + out[1:]
            assert torch.equal(grammar.masks(other, 8), fresh.masks(other, 8))  # other drafts: walked afresh
            commit = out[:2] if out[0] not in engine.eos_token_ids else out[:1]
            for token in commit:  # the walk's masks are dropped at a commit
                grammar.consume(token)
                fresh.consume(token)
            if grammar.ended:
                break


def test_constrained_drafts_raise_acceptance(shipped):
    """The same greedy requests with the drafts walked through the grammar and as the drafter made them: the same
    text (the verifier decides it), more accepted drafts."""
    model, tok, drafter = shipped
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(max_new_tokens=48, stop_token_ids=(tok.eos_token_id,), structured=SPECS["schema"])
    constrained = SpecEngine(model, drafter, tok, draft_policy="fixed")
    raw = SpecEngine(model, drafter, tok, draft_policy="fixed")
    raw._constrain_drafts = lambda *args: None
    with_walk, without = constrained.generate(prompts, params), raw.generate(prompts, params)
    assert [r.token_ids for r in with_walk] == [r.token_ids for r in without]
    accepted = [sum(a - 1 for a in r.stats.acceptance_lengths) for r in with_walk]
    accepted_raw = [sum(a - 1 for a in r.stats.acceptance_lengths) for r in without]
    assert sum(accepted) > sum(accepted_raw), (accepted, accepted_raw)
