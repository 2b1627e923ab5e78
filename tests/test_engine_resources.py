"""Resource hygiene and incremental text.

- `SpecEngine.close()` / `with SpecEngine(...)`: the hooks an engine puts on the target come off again (engines
  built over and over, as training evaluations do, must not pile them up), a closed-and-rebuilt engine is still
  lossless, a closed one refuses to run.
- `IncrementalText` (`flashdraft/engine/detokenize.py`): streaming decodes only the new tokens, yet gives what
  decoding the whole output at once gives (text, stop-string cut, tokens kept, deltas), and its decode work grows
  linearly with the output.
"""

import random

import pytest
import torch

from flashdraft import SamplingParams, SpecEngine
from flashdraft.engine.detokenize import LOOKBACK, IncrementalText, text_decoder
from flashdraft.model.target import TargetModel
from flashdraft.train.evaluate import evaluate_tau
from tiny import greedy_reference, load_tokenizer, make_drafter, make_target

# ---- close() and context-manager support ---------------------------------------------------------------------


def hook_counts(model) -> list[int]:
    return [len(m._forward_hooks) for m in model.modules()]


PROMPTS = [[3, 17, 42, 5], [9, 1, 60, 33, 21, 8, 70]]


@pytest.mark.parametrize("arch,fast_path", [("olmo2", None), ("phi3", None), ("qwen3", False), ("qwen3", None)])
def test_engines_built_and_closed_leave_no_hooks(arch, fast_path):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=4)
    before = hook_counts(target)
    refs = [greedy_reference(target, p, 12) for p in PROMPTS]
    for i in range(4):
        engine = SpecEngine(target, drafter, fast_path=fast_path)
        assert sum(hook_counts(target)) == sum(before) + len(drafter.target_layer_ids)
        if i % 2:
            results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))
            engine.close()
        else:
            with engine:
                results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))
        assert [r.token_ids for r in results] == refs  # lossless after the earlier engines were closed
        assert hook_counts(target) == before
        engine.close()  # idempotent
        assert hook_counts(target) == before


def test_closed_engine_refuses_to_run():
    target = make_target("olmo2")
    with SpecEngine(target, make_drafter(target, block_size=4)) as engine:
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4))
    for use in (lambda: engine.generate([PROMPTS[0]]), lambda: list(engine.stream([PROMPTS[0]])),
                engine.open_batch, lambda: engine.warmup(1), lambda: engine.__enter__()):
        with pytest.raises(RuntimeError, match="closed"):
            use()
    batch = SpecEngine(target).open_batch()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add(batch, [PROMPTS[0]])
    with pytest.raises(RuntimeError, match="closed"):
        engine.step(batch)


def test_shared_target_model_gets_its_layer_ids_back():
    model = make_target("olmo2")
    drafter = make_drafter(model, block_size=4)
    shared = TargetModel(model, [0])
    assert drafter.target_layer_ids != [0]
    before = hook_counts(model)
    with SpecEngine(shared, drafter) as engine:
        assert shared.layer_ids == list(drafter.target_layer_ids)
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6))
    assert shared.layer_ids == [0] and hook_counts(model) == before
    _, features = shared.forward(torch.tensor([PROMPTS[0]]), torch.arange(4)[None], None, None)
    assert features.shape[-1] == shared.hidden_size  # its own tap still captures


def test_repeated_evaluations_and_spec_generate_leave_no_hooks():
    target = make_target("olmo2")
    drafter = make_drafter(target, block_size=4)
    before = hook_counts(target)
    for _ in range(3):
        evaluate_tau(target, drafter, PROMPTS, max_new_tokens=8)
        drafter.spec_generate(target, torch.tensor([PROMPTS[0]]), max_new_tokens=8, stop_token_ids=None)
    assert hook_counts(target) == before
    shared = TargetModel(target, drafter.target_layer_ids)  # the trainer's way: its hooks stay, no more
    with_shared = hook_counts(target)
    for _ in range(3):
        evaluate_tau(shared, drafter, PROMPTS, max_new_tokens=8)
    assert hook_counts(target) == with_shared and shared.layer_ids == list(drafter.target_layer_ids)


def test_dropped_engine_takes_its_hooks_along():
    target = make_target("olmo2")
    before = hook_counts(target)
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    assert hook_counts(target) != before
    del engine
    import gc

    gc.collect()
    assert hook_counts(target) == before


# ---- incremental text -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def full_reference(tok, tokens, stops=(), include_stop=False):
    """What decoding the whole output at once gives: (text, tokens kept, stopped)."""
    text = tok.decode(tokens, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops]
    hits = [(p, s) for p, s in hits if p >= 0]
    if not hits:
        return text, len(tokens), False
    pos, s = min(hits)
    need = text[:pos + len(s)]
    keep = next(n for n in range(1, len(tokens) + 1)
                if tok.decode(tokens[:n], skip_special_tokens=True).startswith(need))
    return text[:pos + (len(s) if include_stop else 0)], keep, True


def run_incremental(tok, tokens, stops=(), include_stop=False, chunks=None, rng=None):
    """Feed `tokens` in cycles of random sizes (as the engine commits them); (text, kept, stopped, deltas)."""
    detok = IncrementalText(tok, tuple(stops), include_stop)
    out, deltas, i = [], [], 0
    rng = rng or random.Random(0)
    while True:
        n = chunks if chunks else rng.randint(1, 6)
        out += tokens[i:i + n]
        i += n
        final = i >= len(tokens)
        keep = detok.update(out, final)
        stopped = keep is not None
        if stopped:
            del out[keep:]
        deltas.append(detok.delta(stopped or final))
        if stopped or final:
            return detok.text, len(out), stopped, deltas


TEXTS = ["héllo wörld € 5 ", "日本語のテキスト", "emoji 🙂🙃 and ✓ ", "def f(x):\n    return x  # naïve\n", "ßçø ĳ ǅ"]


def random_tokens(tok, rng: random.Random, length: int) -> list[int]:
    """Code, multi-byte characters split across byte tokens, special tokens (skipped) and random ids."""
    out: list[int] = []
    while len(out) < length:
        kind = rng.random()
        if kind < 0.5:
            out += tok(rng.choice(TEXTS))["input_ids"]
        elif kind < 0.8:
            out += [rng.randrange(2, len(tok)) for _ in range(rng.randint(1, 4))]
        elif kind < 0.9:
            out.append(rng.choice(tok.all_special_ids))
        else:
            out.append(rng.randrange(100, 300))  # low ids: single bytes, often a lone part of a character
    return out[:length]


def test_text_decoder_calls_the_backend_only_where_it_decodes_alike(tok):
    rng = random.Random(7)
    samples = [random_tokens(tok, rng, rng.randint(1, 40)) for _ in range(50)]
    want = [tok.decode(ids, skip_special_tokens=True) for ids in samples]
    fast = text_decoder(tok)
    tok.decode = lambda *args, **kwargs: pytest.fail("transformers' decode wrapper was called")
    try:  # the backend alone, decoding as transformers' decode does
        assert [fast(ids) for ids in samples] == want
    finally:
        del tok.decode
    # a tokenizer that cleans up tokenization spaces (or any other decode) keeps its own decode
    import copy

    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    calls = []
    cleaning.decode = lambda ids, **kw: calls.append(kw) or "x"
    assert text_decoder(cleaning)([1, 2]) == "x" and calls == [{"skip_special_tokens": True}]


def test_tokenizer_splits_characters(tok):
    ids = tok("日本語 🙂")["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test data below does split characters


@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_equals_full_decode(tok, seed):
    rng = random.Random(seed)
    tokens = random_tokens(tok, rng, rng.randint(1, 120))
    text = tok.decode(tokens, skip_special_tokens=True)
    # stop strings cut from the text itself (so they span token boundaries, split characters, start at 0), plus
    # one that never occurs
    stops = []
    for _ in range(rng.randint(0, 3)):
        if text:
            a = 0 if rng.random() < 0.2 else rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)])
    stops = [s for s in stops if s] + (["\x00never\x00"] if rng.random() < 0.5 else [])
    include = rng.random() < 0.5
    for chunks in (None, 1, 16):
        got_text, kept, stopped, deltas = run_incremental(tok, tokens, stops, include, chunks, random.Random(seed))
        want_text, want_kept, want_stopped = full_reference(tok, tokens, stops, include)
        assert (got_text, kept, stopped) == (want_text, want_kept, want_stopped), (tokens, stops)
        assert "".join(deltas) == got_text


def test_stop_string_at_the_very_start_and_across_tokens(tok):
    tokens = tok("日本語 def f(x):\n    return x")["input_ids"]
    text = tok.decode(tokens)
    for stop in ("日", text[:2], "本語 d", "語", "(x):\n  ", "return x", text):
        for include in (False, True):
            for chunks in (1, 3, 64):
                assert run_incremental(tok, tokens, (stop,), include, chunks)[:3] == \
                    full_reference(tok, tokens, (stop,), include), (stop, include, chunks)


def test_split_character_is_held_back_until_complete(tok):
    tokens = tok("a🙂b")["input_ids"]
    pieces = [tok.decode([t]) for t in tokens]
    assert pieces[0] == "a" and pieces[-1] == "b" and "\ufffd" in pieces[1]
    detok = IncrementalText(tok)
    deltas = []
    for n in range(1, len(tokens) + 1):
        detok.update(tokens[:n], final=n == len(tokens))
        deltas.append(detok.delta(n == len(tokens)))
    assert deltas[0] == "a" and all(d == "" for d in deltas[1:-2]) and deltas[-2] == "🙂" and deltas[-1] == "b"
    # the output ends inside the character: the final text is what a full decode shows
    detok = IncrementalText(tok)
    detok.update(tokens[:2], final=True)
    assert detok.text == tok.decode(tokens[:2]) and detok.text.endswith("\ufffd")


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.decoded = tok, 0, 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.decoded += len(ids)
        return self.tok.decode(ids, **kwargs)


def decode_work(tok, tokens, chunk, stops):
    counting = CountingTokenizer(tok)
    detok = IncrementalText(counting, stops)
    worst = 0
    for end in range(chunk, len(tokens) + chunk, chunk):
        before = counting.decoded
        assert detok.update(tokens[:end], final=end >= len(tokens)) is None
        detok.delta(end >= len(tokens))
        worst = max(worst, counting.decoded - before)
    assert detok.text == tok.decode(tokens, skip_special_tokens=True)
    return counting.decoded, worst


@pytest.mark.parametrize("text", ["def f(x):\n    return x + 1\n", "日本語のテキスト、🙂 ", "naïve café € "])
def test_decode_work_grows_linearly(tok, text):
    ids = tok(text)["input_ids"]
    stops = ("\x00never\x00", "zzzz-not-there")
    for chunk in (1, 5, 16):
        short, worst_short = decode_work(tok, (ids * 400)[:400], chunk, stops)
        long, worst_long = decode_work(tok, (ids * 1600)[:1600], chunk, stops)
        # work per cycle is bounded by the cycle's tokens plus a lookback (a split character: a few more decodes)
        bound = 4 * (2 * chunk + 2 * LOOKBACK + 4)
        assert worst_short <= bound and worst_long <= bound, (chunk, worst_short, worst_long)
        assert long <= 4.4 * short, (chunk, short, long)  # 4x the tokens, 4x the work (quadratic would be 16x)
        assert long <= bound * (1600 // chunk + 1)


def _text_engine(tok):
    """A tiny random Qwen3 (float64) with the project's tokenizer, and a code prompt."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return SpecEngine(Qwen3ForCausalLM(cfg).double().eval(), tokenizer=tok), tok("def main():")["input_ids"]


def _streamed(engine, prompt, params):
    """(the streamed deltas joined, the final result) of one request."""
    deltas, result = [], None
    for ev in engine.stream([prompt], params):
        deltas.append(ev.text)
        result = ev.result or result
    return "".join(deltas), result


def test_engine_stream_with_stop_strings_matches_full_decode(tok):
    """Through the engine: streamed deltas, final text and kept tokens against a full decode of the output."""
    engine, prompt = _text_engine(tok)
    full = engine.generate([prompt], SamplingParams(max_new_tokens=48))[0]
    text = full.text
    assert text == tok.decode(full.token_ids, skip_special_tokens=True)
    rng = random.Random(1)
    for _ in range(6):
        a = rng.choice([0, rng.randrange(len(text))])
        stop = text[a:a + rng.randint(1, 5)]
        for include in (False, True):
            params = SamplingParams(max_new_tokens=48, stop_strings=(stop,), include_stop_str_in_output=include)
            streamed, result = _streamed(engine, prompt, params)
            want_text, keep, stopped = full_reference(tok, full.token_ids, (stop,), include)
            assert result.text == want_text == streamed
            assert result.token_ids == full.token_ids[:keep]
            assert result.finish_reason == ("stop" if stopped else "length")


def test_a_stop_ids_text_is_left_out_unless_asked(tok):
    """As in vLLM: a row ended by a stop id keeps the id in its tokens, not its text in the text (streamed or
    not); `include_stop_str_in_output` keeps it. Stop ids that decode to nothing (EOS) change nothing."""
    engine, prompt = _text_engine(tok)
    free = engine.generate([prompt], SamplingParams(max_new_tokens=24))[0]
    stop = next(t for t in free.token_ids[2:] if tok.decode([t]))  # a stop id with text, a few tokens in
    cut = free.token_ids[:free.token_ids.index(stop) + 1]
    for include in (False, True):
        params = SamplingParams(max_new_tokens=24, stop_token_ids=(stop,), include_stop_str_in_output=include)
        streamed, result = _streamed(engine, prompt, params)
        assert result.token_ids == cut and result.finish_reason == "stop"
        want = tok.decode(cut if include else cut[:-1], skip_special_tokens=True)
        assert result.text == want == streamed, include
    assert engine.generate([prompt], SamplingParams(max_new_tokens=24, stop_token_ids=(stop,)))[0].text == \
        tok.decode(cut[:-1], skip_special_tokens=True)


def test_special_tokens_text_only_when_asked(tok):
    """skip_special_tokens (vLLM's, default true): an output holding special tokens (<|mask|> pushed in by a logit
    bias) shows them in its text, streamed and not, only with skip_special_tokens=False."""
    engine, prompt = _text_engine(tok)
    mask = tok.convert_tokens_to_ids("<|mask|>")
    for skip in (True, False):
        params = SamplingParams(max_new_tokens=12, logit_bias={mask: 3.0}, skip_special_tokens=skip)
        streamed, result = _streamed(engine, prompt, params)
        assert mask in result.token_ids
        assert result.text == tok.decode(result.token_ids, skip_special_tokens=skip) == streamed
        assert ("<|mask|>" in result.text) == (not skip)
