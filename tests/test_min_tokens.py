"""min_tokens and allowed_token_ids (vLLM's). min_tokens: the first min_tokens output tokens
cannot be stop ids, and stop strings count only past them.

Greedy rows are compared with transformers' `generate(min_new_tokens=...)` (its processor sets the end-of-sequence
ids' logits to -inf for the first min_new_tokens tokens), through drafting of every acceptance length (an oracle
drafter), the DFlash drafter and plain decoding, beside rows without it, on both target paths; sampled rows with
the target's own race under the request's noise with the stop ids masked, computed here without an engine.
allowed_token_ids: every other id's logit is -inf; greedy rows against transformers'
`generate(prefix_allowed_tokens_fn=...)`, sampled rows against the restricted target's race, the same ways.
bad_words: the last token of a banned sequence is -inf where the output would complete it; greedy rows against
transformers' `generate(bad_words_ids=...)` (words whose other tokens are not in the prompt, where its rule, which
reads the prompt too, and vLLM's, which reads the output only, agree), sampled rows against the race.
"""

from __future__ import annotations

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine, StructuredOutput
from flashdraft.engine.detokenize import IncrementalText
from flashdraft.engine.noise import exponential_noise, race
from tiny import engine_with, load_tokenizer, make_drafter, make_target

PROMPTS = [[3, 17, 42, 8, 11], [5, 9], [60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


@torch.inference_mode()
def assert_seeded_row_is_the_race(target, prompt: list[int], q: SamplingParams, process) -> list[int]:
    """The seeded row's tokens, plain and drafted, beside another sampled row, equal the race under its noise on
    softmax(process(logits, j, output so far) / T), one target forward per token without an engine (stopping at its
    stop ids); returns them."""
    ids, expected = list(prompt), []
    for j in range(q.max_new_tokens):
        logits = process(target(torch.tensor([ids])).logits[0, -1].float(), j, expected)
        noise = exponential_noise(torch.tensor([q.seed]), torch.tensor([j]), 1, logits.shape[-1])[0, 0]
        expected.append(int(race(torch.softmax(logits / q.temperature, dim=-1), noise)))
        ids.append(expected[-1])
        if expected[-1] in q.stop_token_ids:
            break
    for engine in (SpecEngine(target), SpecEngine(target, make_drafter(target, block_size=4), draft_policy="fixed")):
        got = engine.generate([prompt, PROMPTS[1]], [q, SamplingParams(max_new_tokens=16, temperature=1.0, seed=2)])
        assert got[0].token_ids == expected
    return expected


@torch.inference_mode()
def generate_min(model, prompt: list[int], max_new: int, stop: list[int], min_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=0, eos_token_id=stop, min_new_tokens=min_new or None)[0, len(prompt):].tolist()
    return out[:out.index(next(t for t in out if t in stop)) + 1] if any(t in stop for t in out) else out


def stops_for(target, prompt: list[int]) -> list[int]:
    """Two tokens the free greedy output holds early (the 2nd and 4th): without min_tokens it stops at once."""
    free = generate_min(target, prompt, 16, [], 0)
    return [free[1], free[3]]


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("proposer", ["oracle", "dflash", "none"])
def test_greedy_output_is_the_targets_with_min_new_tokens(target, fast_path, proposer):
    max_new = 20
    stops = [stops_for(target, p) for p in PROMPTS]
    mins = [12, 0, 6]
    expected = [generate_min(target, p, max_new, s, m) for p, s, m in zip(PROMPTS, stops, mins)]
    assert len(generate_min(target, PROMPTS[0], max_new, stops[0], 0)) <= 4 < 12 < len(expected[0])
    engine = engine_with(proposer, target, PROMPTS, expected, fast_path, seed=6)
    params = [SamplingParams(max_new_tokens=max_new, stop_token_ids=tuple(s), min_tokens=m)
              for s, m in zip(stops, mins)]
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == expected
    for r, s, m in zip(results, stops, mins):
        assert not set(r.token_ids[:m]) & set(s)


def test_seeded_sampling_is_the_masked_targets_race(target):
    prompt, stops = PROMPTS[0], stops_for(target, PROMPTS[0])
    q = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, stop_token_ids=tuple(stops), min_tokens=10)

    def masked(logits, j, _):
        if j < q.min_tokens:
            logits[stops] = float("-inf")
        return logits

    assert_seeded_row_is_the_race(target, prompt, q, masked)


def test_stop_strings_count_only_past_min_tokens():
    """A stop string ending in the text of the first min_tokens tokens does not stop the row; one that ends later
    does, as does one straddling that point (vLLM: stop strings are checked once the output is longer than
    min_tokens)."""
    tok = load_tokenizer()
    ids = tok.encode("a = 1\nb = 2\nc = 3\nd = 4\n")
    n_first = len(tok.encode("a = 1\n"))

    def run(stop: str, min_tokens: int, step: int = 1) -> str:
        detok = IncrementalText(tok, (stop,), hold_stops=min_tokens > 0)
        for n in range(step, len(ids) + step, step):
            n = min(n, len(ids))
            if detok.holding_stops and n > min_tokens:  # what the engine does (`SpecEngine._update_text`)
                detok.search_from(len(tok.decode(ids[:min_tokens])))
            if detok.update(ids[:n], final=n == len(ids)) is not None:
                break
        return detok.text

    for step in (1, 3, len(ids)):  # tokens a token at a time, in blocks, all at once: the same text
        assert run("\n", 0, step) == "a = 1"
        assert run("\n", n_first, step) == "a = 1\nb = 2"  # the first newline ends in the first tokens' text
        assert run("1\nb", n_first, step) == "a = "  # straddles the point: it counts
        assert run("= 1", n_first + 2, step) == "a = 1\nb = 2\nc = 3\nd = 4\n"


def test_bad_min_tokens_are_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="structured output"):
        SamplingParams(min_tokens=2, structured=StructuredOutput(regex="a+"))


# ---- allowed_token_ids (vLLM's): every other id's logit is -inf ------------------------------------------------------


@torch.inference_mode()
def generate_allowed(model, prompt: list[int], max_new: int, allowed: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          pad_token_id=0, prefix_allowed_tokens_fn=(lambda batch, sofar: allowed) if allowed else None
                          )[0, len(prompt):].tolist()


def allowed_for(target, prompt: list[int]) -> list[int]:
    """Ids the free output uses but not its 3rd token, and a few others: the restricted output differs."""
    free = generate_allowed(target, prompt, 12, [])
    return sorted((set(free) - {free[2]}) | {7, 50, 90})


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("proposer", ["oracle", "dflash", "none"])
def test_greedy_output_keeps_to_the_allowed_ids(target, fast_path, proposer):
    """Greedy output equals transformers' `generate(prefix_allowed_tokens_fn=...)`, beside a row without a limit."""
    max_new = 20
    allowed = [allowed_for(target, PROMPTS[0]), [], allowed_for(target, PROMPTS[2])]
    expected = [generate_allowed(target, p, max_new, a) for p, a in zip(PROMPTS, allowed)]
    assert expected[0] != generate_allowed(target, PROMPTS[0], max_new, [])
    engine = engine_with(proposer, target, PROMPTS, expected, fast_path, seed=8)
    params = [SamplingParams(max_new_tokens=max_new, allowed_token_ids=tuple(a)) for a in allowed]
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected


def test_seeded_sampling_keeps_to_the_allowed_ids(target):
    allowed = allowed_for(target, PROMPTS[0])
    q = SamplingParams(max_new_tokens=16, temperature=1.0, seed=9, allowed_token_ids=tuple(allowed))

    def restricted(logits, j, _):
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = logits[allowed]
        return keep

    assert set(assert_seeded_row_is_the_race(target, PROMPTS[0], q, restricted)) <= set(allowed)


def test_bad_allowed_token_ids_are_refused(target):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(-1, 3))
    with pytest.raises(ValueError, match="structured output"):
        SamplingParams(allowed_token_ids=(3,), structured=StructuredOutput(regex="a+"))
    with pytest.raises(ValueError, match="nothing could"):
        SamplingParams(allowed_token_ids=(3,), stop_token_ids=(3,), min_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SpecEngine(target).generate([PROMPTS[0]], SamplingParams(allowed_token_ids=(10 ** 6,)))


# ---- bad_words (vLLM's): a banned sequence is never completed ----------------------------------------------------------


@torch.inference_mode()
def generate_banned(model, prompt: list[int], max_new: int, words: list[tuple[int, ...]]) -> list[int]:
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          pad_token_id=0, bad_words_ids=[list(w) for w in words] or None)[0, len(prompt):].tolist()


def words_for(output, prompt: list[int], max_new: int) -> list[tuple[int, ...]]:
    """A word of 1, 2 and 3 tokens, each taken from `output(words)` with the words before it banned, so each one
    changes the output; their other tokens are not in the prompt."""
    words: list[tuple[int, ...]] = []
    for n in (1, 2, 3):
        out = output(words)
        word = next(tuple(out[end - n + 1:end + 1]) for end in range(n + 1, max_new)
                    if not set(out[end - n + 1:end]) & set(prompt))
        words.append(word)
        assert output(words) != out
    return words


@pytest.mark.parametrize("fast_path", [None, False], ids=["fast", "generic"])
@pytest.mark.parametrize("proposer", ["oracle", "dflash", "none"])
def test_greedy_output_never_completes_a_bad_word(target, fast_path, proposer):
    """Greedy output equals transformers' `generate(bad_words_ids=...)`, beside a row without bad words."""
    max_new = 20
    words = [words_for(lambda w, p=p: generate_banned(target, p, max_new, w), p, max_new) if p else []
             for p in (PROMPTS[0], None, PROMPTS[2])]
    expected = [generate_banned(target, p, max_new, w) for p, w in zip(PROMPTS, words)]
    engine = engine_with(proposer, target, PROMPTS, expected, fast_path, seed=10)
    params = [SamplingParams(max_new_tokens=max_new, bad_words=tuple(w)) for w in words]
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected


def test_a_bad_word_reads_the_output_only(target):
    """vLLM's rule: a word whose other tokens end the prompt is not completed by the first output token only if the
    output holds them; here the prompt does, so the free output is unchanged (transformers' rule would ban it)."""
    free = generate_banned(target, PROMPTS[0], 8, [])
    word = (PROMPTS[0][-1], free[0])
    assert generate_banned(target, PROMPTS[0], 8, [word]) != free
    got = SpecEngine(target).generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, bad_words=(word,)))
    assert got[0].token_ids == free


def test_seeded_sampling_never_completes_a_bad_word(target):
    plain = SpecEngine(target)

    def sampled(words):
        q = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, bad_words=tuple(words))
        return plain.generate([PROMPTS[0]], q)[0].token_ids

    words = words_for(sampled, PROMPTS[0], 16)
    q = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, bad_words=tuple(words))

    def banned(logits, j, output):
        for word in words:
            if len(word) - 1 <= len(output) and tuple(output[len(output) - len(word) + 1:]) == word[:-1]:
                logits[word[-1]] = float("-inf")
        return logits

    assert_seeded_row_is_the_race(target, PROMPTS[0], q, banned)


def test_bad_bad_words_are_refused(target):
    for bad in (((),), ((3, -1),), (("a",),), 5):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="structured output"):
        SamplingParams(bad_words=((3,),), structured=StructuredOutput(regex="a+"))
    with pytest.raises(ValueError, match="nothing could"):
        SamplingParams(allowed_token_ids=(3, 4), bad_words=((3,), (4,), (5, 4)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SpecEngine(target).generate([PROMPTS[0]], SamplingParams(bad_words=((3, 10 ** 6),)))
