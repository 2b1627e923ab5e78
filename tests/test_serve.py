"""`flashdraft serve` end to end: the real server (uvicorn in a thread, loopback port) with a tiny random target +
DFlash drafter saved to disk with the project's tokenizer (float32), driven by the `openai` client and raw HTTP.

Covered: completions / chat / streaming / include_usage / acceptance statistics through the openai client; 64
concurrent streams that each equal the same request served alone; 50 malformed or hostile requests answered 4xx
in the OpenAI error shape with the server still correct afterwards; client disconnects (streaming and not) freeing
their batch slot; 429 on a full queue; Bearer auth; no chat template -> 400; /metrics; graceful shutdown.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from flashdraft.engine import SamplingParams, SpecEngine, StructuredOutput  # noqa: E402
from flashdraft.engine.noise import NOISE_VERSION  # noqa: E402
from flashdraft.loading import load_pair  # noqa: E402
from flashdraft.serve.app import ServeConfig, create_app  # noqa: E402
from tiny import save_text_pair  # noqa: E402

CHAT_TEMPLATE = ("{% if tools %}<|tools|>\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n"
                 "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")
MODEL = "tiny"
MAX_LEN = 384


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_pair")
    save_text_pair(root, max_positions=512)
    return root


def make_engine(pair, drafter=True, chat=True, draft_policy="fixed") -> SpecEngine:
    """A fresh engine (own model copies: engines are single-threaded and hook their target's layers). The fixed
    draft policy by default: a request's drafts then do not depend on timing, so served statistics can be compared
    with a reference engine's (test_adaptive_server covers the default policy)."""
    target, tokenizer, draft = load_pair(pair / "target", pair / "drafter" if drafter else None, "cpu", "float32")
    tokenizer.chat_template = CHAT_TEMPLATE if chat else None  # chat=False: a tokenizer without a template
    return SpecEngine(target, draft, tokenizer, draft_policy=draft_policy)


class Live:
    """uvicorn serving `app` in a background thread on a free loopback port."""

    def __init__(self, app):
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=20))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    @property
    def scheduler(self):
        return self.app.state.server.scheduler

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0:
                return h
            assert time.monotonic() < deadline, f"server did not go idle: {h}"
            time.sleep(0.02)

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total


@contextmanager
def live(app):
    server = Live(app)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(pair):
    """The same model served alone: engine.generate on one prompt at a time."""
    engine = make_engine(pair)
    eos = engine.tokenizer.eos_token_id

    def run(prompt_ids, max_tokens, **kw):
        params = SamplingParams(**{"max_new_tokens": max_tokens, "stop_token_ids": (eos,), **kw})
        return engine.generate([prompt_ids], params)[0]

    run.tokenizer = engine.tokenizer
    return run


@pytest.fixture(scope="module")
def server(pair):
    app = create_app(make_engine(pair), ServeConfig(model_name=MODEL, max_model_len=MAX_LEN, max_batch_size=16,
                                                    max_queue=64))
    with live(app) as s:
        yield s


def client(server, **kw):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


# ---- the openai client -------------------------------------------------------------------------------------------


def test_openai_completion_and_stats(server, reference):
    prompt = "def add(a, b):"
    resp = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    expected = reference(reference.tokenizer(prompt)["input_ids"], 12)
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == len(reference.tokenizer(prompt)["input_ids"])
    stats = resp.model_extra["dflash"]
    assert stats["drafts"] == expected.stats.num_drafts and stats["block_size"] == 8
    assert stats["draft_tokens"] == 7 * stats["drafts"] and stats["verify_widths"] == [8] * stats["drafts"]
    assert stats["one_token_steps"] == 0
    assert stats["accepted_tokens"] == expected.stats.num_accepted_tokens
    assert stats["acceptance_histogram"] == expected.stats.histogram
    # tau is the mean acceptance length: 1 + accepted / drafts, the engine's own figure for this request
    assert stats["drafts"] > 0 and stats["tau"] == pytest.approx(expected.stats.tau, abs=1e-4)
    assert stats["tau"] == pytest.approx(1 + stats["accepted_tokens"] / stats["drafts"], abs=1e-4)
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_openai_chat(server, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}]
    resp = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    expected = reference(list(ids), 10)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.model_extra["dflash"]["drafts"] == expected.stats.num_drafts
    # max_completion_tokens is the newer name of max_tokens; list-of-text-parts content is joined
    parts = [{"role": "user", "content": [{"type": "text", "text": "sort "}, {"type": "text", "text": "a list"}]}]
    resp2 = client(server).chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=10,
                                                   temperature=0)
    assert resp2.usage.completion_tokens == resp.usage.completion_tokens


def test_openai_streaming_with_usage(server, reference):
    prompt = "import os\n"
    stream = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    expected = reference(reference.tokenizer(prompt)["input_ids"], 16)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["dflash"]["drafts"] == expected.stats.num_drafts
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1

    messages = [{"role": "user", "content": "hello"}]
    chat = list(client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    expected = reference(list(ids), 9)
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == expected.text
    assert chat[-1].usage.prompt_tokens == len(ids) and chat[-1].model_extra["dflash"]["drafts"] >= 1
    # without include_usage: no usage chunk, still [DONE]-terminated
    plain = list(client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                                   stream=True))
    assert plain[-1].choices[0].finish_reason in ("stop", "length") and plain[-1].usage is None


def test_sampled_request_is_seeded_and_stop_strings(server, reference):
    c = client(server)
    a = c.completions.create(model=MODEL, prompt="x = ", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    b = c.completions.create(model=MODEL, prompt="x = ", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text
    # the noise's version, so that a client can tell when a seed's text may change (OpenAI's field for it)
    assert a.system_fingerprint == b.system_fingerprint == f"flashdraft-noise{NOISE_VERSION}"
    chunks = list(c.completions.create(model=MODEL, prompt="x = ", max_tokens=4, temperature=0.8, seed=7, stream=True))
    assert {chunk.system_fingerprint for chunk in chunks} == {a.system_fingerprint}
    full = c.completions.create(model=MODEL, prompt="y = ", max_tokens=20, temperature=0).choices[0].text
    stop = full[5:8]
    if stop.strip():
        cut = c.completions.create(model=MODEL, prompt="y = ", max_tokens=20, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.find(stop)]


def test_logprobs_in_every_format(server, reference):
    """Completions, chat and streams carry the engine's figures for exactly the tokens of the text (the engine's
    figures against the target's own forward: tests/test_logprobs.py)."""
    c, tok = client(server), reference.tokenizer
    prompt = "def add(a, b):"
    expected = reference(tok(prompt)["input_ids"], 12, logprobs=2)
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [tok.decode([e.token]) for e in expected.logprobs] and "".join(lp.tokens) == expected.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-6)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, figure, top, e in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, expected.logprobs):
        assert top[token] == figure and len(top) <= 3  # the chosen token beside the 2 most likely
        assert {tok.decode([t]): v for t, v in e.top}.items() <= {k: pytest.approx(v) for k, v in top.items()}.items()

    stream = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                       stream=True))
    parts = [ch.choices[0].logprobs for ch in stream if ch.choices and ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert sum((p.text_offset for p in parts), []) == lp.text_offset

    messages = [{"role": "user", "content": "sort a list"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = reference(list(ids), 10, logprobs=3)
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                     top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [x.token for x in content] == [tok.decode([e.token]) for e in expected.logprobs]
    assert [x.logprob for x in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-6)
    for x, e in zip(content, expected.logprobs):
        assert bytes(x.bytes).decode() == x.token and len(x.top_logprobs) == 3
        assert [t.token for t in x.top_logprobs] == [tok.decode([t]) for t, _ in e.top]
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content] and all(x.top_logprobs == [] for x in streamed)
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_prompt_logprobs_are_the_targets_own(server, pair):
    """vLLM's prompt_logprobs: per prompt token (null first) its log-probability and rank and the k likeliest tokens
    ranked 1..k, against the target's own forward over the prompt; per choice in completions, once in chat; not with
    stream (400)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32)
    tok = server.app.state.server.tokenizer

    def own(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(target(torch.tensor([ids])).logits[0].double(), dim=-1)

    def check(entries, ids, k):
        logp = own(ids)
        assert len(entries) == len(ids) and entries[0] is None
        for pos, entry in enumerate(entries[1:], start=1):
            row, token = logp[pos - 1], ids[pos]
            top = row.topk(k).indices.tolist()
            assert set(entry) == {str(t) for t in top + [token]}
            assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
            near = 1e-5  # the server's figures are float32's: a token within that of this one may rank either way
            rank = entry[str(token)]["rank"]
            assert int((row > row[token] + near).sum()) < rank <= int((row >= row[token] - near).sum())
            assert [entry[str(t)]["rank"] for t in top] == list(range(1, k + 1))
            assert all(entry[str(t)]["decoded_token"] == tok.decode([t]) for t in top + [token])

    ids = tok("def add(a, b):\n    return")["input_ids"]
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 2}).json()
    assert [c["prompt_logprobs"] for c in resp["choices"]][0] == resp["choices"][1]["prompt_logprobs"]
    check(resp["choices"][0]["prompt_logprobs"], ids, 2)
    echo = httpx.post(f"{server.url}/v1/completions", timeout=30, json={  # with echo's own k beside it
        "model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 3, "prompt_logprobs": 0}).json()
    check(echo["choices"][0]["prompt_logprobs"], ids, 0)
    assert len(echo["choices"][0]["logprobs"]["top_logprobs"][1]) >= 3
    messages = [{"role": "user", "content": "sort a list"}]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1}).json()
    check(chat["prompt_logprobs"], tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False), 1)
    assert "prompt_logprobs" not in chat["choices"][0]
    plain = httpx.post(f"{server.url}/v1/completions", timeout=30, json={"model": MODEL, "prompt": ids,
                                                                       "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    for bad in ({"stream": True, "prompt_logprobs": 1}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 2, **bad})
        assert resp.status_code == 400 and "prompt_logprobs" in resp.text, resp.text


def test_echo_scores_the_prompt(server, reference):
    """What evaluation harnesses send to score a continuation (lm-eval's loglikelihood over the completions API):
    token ids, echo, one token, logprobs 1; the prompt's figures come first, its first token's null."""
    c, tok = client(server), reference.tokenizer
    ids = tok("def add(a, b):\n    return")["input_ids"]
    expected = reference(ids, 1, logprobs=1, prompt_logprobs=1)
    resp = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text == tok.decode(ids) + expected.text and resp.usage.completion_tokens == 1
    assert lp.tokens == [tok.decode([t]) for t in ids + expected.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [e.logprob for e in expected.prompt_logprobs[1:] + expected.logprobs], abs=1e-6)
    assert all(top[token] == figure for token, figure, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                                   lp.top_logprobs[1:]))
    stream = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == choice.text
    parts = [ch.choices[0].logprobs for ch in stream if ch.choices and ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens and sum((p.text_offset for p in parts), []) == lp.text_offset
    assert sum((p.token_logprobs for p in parts), [])[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    text_only = c.completions.create(model=MODEL, prompt="x = 1", max_tokens=3, temperature=0, echo=True)
    assert text_only.choices[0].text.startswith("x = 1") and text_only.choices[0].logprobs is None
    # max_tokens 0: the prompt scored, nothing generated (other harnesses' way), streamed or not
    scored = c.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].text == tok.decode(ids) and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.tokens == lp.tokens[:-1]
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-6)
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == tok.decode(ids)
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="only allowed with 'echo'"):
        c.completions.create(model=MODEL, prompt=ids, max_tokens=0, logprobs=1)


def test_logit_bias_is_served(server, reference):
    """The served text under a bias is the engine's under the same bias (the biased target's own: tests/
    test_logit_bias.py), chat and completions alike, and a ban holds."""
    c, tok = client(server), reference.tokenizer
    prompt = "def add(a, b):"
    free = reference(tok(prompt)["input_ids"], 12)
    banned = free.token_ids[2]
    bias = {str(banned): -100, str(free.token_ids[0]): -1.5}
    expected = reference(tok(prompt)["input_ids"], 12, logit_bias={int(k): v for k, v in bias.items()})
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logit_bias=bias)
    assert resp.choices[0].text == expected.text != free.text and banned not in expected.token_ids
    messages = [{"role": "user", "content": "sort a list"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = reference(list(ids), 8, logit_bias={int(k): v for k, v in bias.items()})
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logit_bias=bias)
    assert chat.choices[0].message.content == expected.text


def test_penalties_are_served(server, reference):
    """Presence, frequency and repetition penalties reach the engine (the target's own text under them:
    tests/test_penalties.py)."""
    c, tok = client(server), reference.tokenizer
    ids = tok("import os\n")["input_ids"]
    free = reference(ids, 16)
    for fields in ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"repetition_penalty": 1.6}):
        expected = reference(ids, 16, **fields)
        extra = {"extra_body": {"repetition_penalty": fields.pop("repetition_penalty")}} \
            if "repetition_penalty" in fields else {}
        resp = c.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0, **fields, **extra)
        assert resp.choices[0].text == expected.text != free.text


def test_structured_output_is_served(server, reference):
    """OpenAI's response_format and vLLM's structured_outputs reach the engine as its StructuredOutput (the
    constrained target's own text: tests/test_structured.py), in chat, completions and streams."""
    c, tok = client(server), reference.tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    messages = [{"role": "user", "content": "answer in JSON"}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    expected = reference(ids, 40, structured=StructuredOutput(json_schema=schema))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format=fmt)
    assert chat.choices[0].message.content == expected.text and expected.text.startswith("{")
    if expected.finish_reason == "stop":
        assert set(json.loads(expected.text)) == {"ok", "color"}
    prompt = tok("def add(a, b):")["input_ids"]
    for spec, body in ((StructuredOutput(regex=r"[a-z]+ = [0-9]{1,3}"), {"regex": r"[a-z]+ = [0-9]{1,3}"}),
                       (StructuredOutput(choice=("yes", "no")), {"choice": ["yes", "no"]}),
                       (StructuredOutput(json_object=True), {"json_object": True})):
        expected = reference(prompt, 24, structured=spec)
        resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"structured_outputs": body})
        assert resp.choices[0].text == expected.text
        streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"structured_outputs": body}) if chunk.choices)
        assert streamed == expected.text
    assert resp.choices[0].text.startswith("{")
    json_mode = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert json_mode.choices[0].text == resp.choices[0].text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                             "parameters": {"type": "object", "additionalProperties": False,
                                                            "required": ["city"],
                                                            "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "cet"]}}}}}


def test_forced_tool_calls_are_served(server, reference):
    """tool_choice naming a function, or "required": the output is the calls (the constrained target's own text,
    its arguments following the schema), returned as tool_calls; a stream sends the arguments as they come."""
    c, tok = client(server), reference.tokenizer
    messages = [{"role": "user", "content": "weather in Paris?"}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                       tools=[WEATHER, TIME]))  # the template lists the tools
    named = {"type": "function", "function": {"name": "get_weather"}}
    expected = reference(ids, 48, structured=StructuredOutput(json_schema=WEATHER["function"]["parameters"],
                                                              any_whitespace=False))
    assert expected.finish_reason == "stop"  # the call finished: it parses
    resp = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                     tools=[WEATHER, TIME], tool_choice=named)
    choice = choice_named = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == expected.text
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo") and call.id.startswith("call_")
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                            tools=[WEATHER, TIME], tool_choice=named, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert not "".join(d.content or "" for d in deltas)
    streamed = [t for d in deltas for t in d.tool_calls or ()]  # the arguments as they were generated
    assert [(t.function.name, t.type, bool(t.id)) for t in streamed if t.function.name] == [
        ("get_weather", "function", True)] and streamed[0].function.name
    assert "".join(t.function.arguments for t in streamed) == expected.text and {t.index for t in streamed} == {0}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    resp = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, temperature=0,
                                     tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = resp.choices[0]
    if choice.finish_reason == "tool_calls":
        (call,) = choice.message.tool_calls
        schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
        assert set(json.loads(call.function.arguments)) == set(schema["required"])
    else:  # cut at max_tokens: the partial call is the content
        assert choice.finish_reason == "length" and choice.message.content.startswith("[")
    # the conversation goes on: the assistant's call and the tool's answer render through the template
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                          "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert c.chat.completions.create(model=MODEL, messages=follow, max_tokens=4, temperature=0,
                                     tools=[WEATHER], tool_choice="none").choices[0].message.tool_calls is None
    assert choice_named.message.tool_calls[0].id != call.id


def test_auto_tool_calls_read_with_the_hermes_parser(pair, reference):
    """tool_choice "auto" with --tool-call-parser hermes: <tool_call> blocks in the text become tool_calls, the text
    before them the content, held back in a stream from where a block may begin. The random tiny model is steered
    into writing one by a regex (structured_outputs), as a trained template would."""
    app = create_app(make_engine(pair), ServeConfig(model_name=MODEL, max_model_len=MAX_LEN, tool_call_parser="hermes"))
    regex = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}</tool_call>'
    with live(app) as s:
        c = client(s)
        body = dict(model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=64, temperature=0,
                    tools=[WEATHER], extra_body={"structured_outputs": {"regex": regex}})
        choice = c.chat.completions.create(**body).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
        chunks = [ch for ch in c.chat.completions.create(**body, stream=True) if ch.choices]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        calls = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or ()]
        assert content == "Sure." and [t.function.arguments for t in calls] == [call.function.arguments]
        plain = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, tools=[WEATHER])
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_batched_prompts_and_n_choices(server, reference):
    """A batch of prompts times n: choice i * n + j is prompt i's j-th, each what the prompt gives served alone
    (greedy: all n the same; seeded: the first choice is the n = 1 request's, the others their own seeds');
    streamed, every choice's chunks carry its index and join into the same texts."""
    c, tok = client(server), reference.tokenizer
    prompts = ["def add(a, b):", "import os\n", "class A:"]
    greedy = c.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0, n=2, logprobs=1)
    assert [ch.index for ch in greedy.choices] == list(range(6))
    alone = [reference(tok(p)["input_ids"], 10, logprobs=1) for p in prompts]
    for ch in greedy.choices:
        expected = alone[ch.index // 2]
        assert ch.text == expected.text
        assert ch.logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-6)
    assert greedy.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    assert greedy.usage.completion_tokens == 2 * sum(len(e.token_ids) for e in alone)
    stats = greedy.model_extra["dflash"]
    assert stats["drafts"] == 2 * sum(e.stats.num_drafts for e in alone)
    assert stats["tau"] == pytest.approx(1 + stats["accepted_tokens"] / stats["drafts"], abs=1e-4)
    ids = [tok(p)["input_ids"] for p in prompts[:2]]  # token-id prompts batched as lm-eval-harness sends them
    as_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert [ch.text for ch in as_ids.choices] == [alone[0].text, alone[1].text]

    sampled = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1, seed=5, n=4)
    single = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1, seed=5)
    texts = [ch.text for ch in sampled.choices]
    assert texts[0] == single.choices[0].text and len(set(texts)) > 1
    again = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1, seed=5, n=4)
    assert [ch.text for ch in again.choices] == texts

    streamed = {}
    chunks = list(c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1, seed=5, n=4,
                                       stream=True, stream_options={"include_usage": True}))
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == texts
    assert sum(1 for ch in chunks for choice in ch.choices if choice.finish_reason) == 4
    assert chunks[-1].usage.completion_tokens == sampled.usage.completion_tokens
    messages = [{"role": "user", "content": "sort a list"}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1, seed=3, n=3)
    chat_stream = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1,
                                                 seed=3, n=3, stream=True))
    joined = {}
    for ch in chat_stream:
        for choice in ch.choices:
            joined[choice.index] = joined.get(choice.index, "") + (choice.delta.content or "")
    assert [joined[i] for i in range(3)] == [ch.message.content for ch in chat.choices]
    server.wait_idle()


# ---- load: 64 concurrent streams --------------------------------------------------------------------------------


async def _stream(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    out = {"text": "", "ids": set(), "final": None, "usage": None, "done": False}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                continue
            chunk = json.loads(data)
            out["ids"].add(chunk["id"])
            if chunk["choices"]:
                out["text"] += chunk["choices"][0]["text"]
                if chunk["choices"][0]["finish_reason"]:
                    out["final"] = chunk
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
    return out


def test_64_concurrent_streams_equal_served_alone(server, reference):
    tok = reference.tokenizer
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    prompts = [f"def {words[i % 8]}_{i}(x):\n    return x * {i} + " for i in range(64)]
    budgets = [6 + (7 * i) % 23 for i in range(64)]
    drafts_before = server.metric("spec_decode_num_drafts_total")

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}} for p, n in zip(prompts, budgets)]
            return await asyncio.gather(*(_stream(http, server.url, b) for b in bodies))

    start = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - start
    ids = set()
    total_drafts = 0
    for prompt, budget, got in zip(prompts, budgets, results):
        expected = reference(tok(prompt)["input_ids"], budget)
        assert got["done"] and len(got["ids"]) == 1, prompt
        ids |= got["ids"]
        assert got["text"] == expected.text, prompt
        assert got["usage"]["completion_tokens"] == len(expected.token_ids)
        assert got["final"]["choices"][0]["finish_reason"] == expected.finish_reason
        assert got["final"]["dflash"]["drafts"] == expected.stats.num_drafts
        total_drafts += got["final"]["dflash"]["drafts"]
    assert len(ids) == 64  # nothing lost, nothing merged
    assert server.wait_idle()["running"] == 0
    assert server.metric("spec_decode_num_drafts_total") - drafts_before == total_drafts
    print(f"64 streams in {elapsed:.2f}s")


def test_adaptive_server_keeps_the_text_and_reports_its_choices(pair, reference):
    """The default (adaptive) draft policy under 16 concurrent greedy requests: each text equals the request served
    alone; each response reports the widths its drafting cycles verified and its one-token steps, and /metrics
    counts proposed vs verified draft tokens and one-token steps."""
    app = create_app(make_engine(pair, draft_policy="adaptive"),
                     ServeConfig(model_name=MODEL, max_model_len=MAX_LEN, max_batch_size=16, max_queue=64))
    prompts = [f"def f_{i}(x):\n    return x + {i}" + ("\n" if i % 2 else "") for i in range(16)]
    with live(app) as srv:
        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                bodies = [{"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}} for p in prompts]
                return await asyncio.gather(*(_stream(http, srv.url, b) for b in bodies))

        results = asyncio.run(main())
        verified = steps = 0
        for prompt, got in zip(prompts, results):
            assert got["text"] == reference(reference.tokenizer(prompt)["input_ids"], 24).text, prompt
            stats = got["final"]["dflash"]
            assert len(stats["verify_widths"]) == stats["drafts"] and all(2 <= w <= 8 for w in stats["verify_widths"])
            assert stats["draft_tokens"] == sum(w - 1 for w in stats["verify_widths"])
            assert stats["accepted_tokens"] <= stats["draft_tokens"]
            verified += stats["draft_tokens"]
            steps += stats["one_token_steps"]
        assert srv.wait_idle()["running"] == 0
        assert srv.metric("spec_decode_num_draft_tokens_total") == verified
        assert srv.metric("spec_decode_num_one_token_steps_total") == steps
        assert srv.metric("spec_decode_num_proposed_tokens_total") == 7 * srv.metric("spec_decode_num_drafts_total")


# ---- hostile requests ---------------------------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _with(base, **kw):
    body = dict(base)
    for k, v in kw.items():
        if v is _DROP:
            body.pop(k)
        else:
            body[k] = v
    return body


_DROP = object()

HOSTILE = [
    # (name, path, body (dict -> JSON, bytes -> raw), status, words the message must contain)
    ("bad json", C, b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("invalid utf-8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("json array body", C, b"[1, 2, 3]", 400, "JSON object"),
    ("empty body", C, b"", 400, "empty"),
    ("deep nesting", C, b"[" * 100000 + b"]" * 100000, 400, ""),
    ("NaN temperature", C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("missing model", C, _with(OK, model=_DROP), 400, "model"),
    ("missing prompt", C, _with(OK, prompt=_DROP), 400, "prompt"),
    ("max_tokens as string", C, _with(OK, max_tokens="10"), 400, "max_tokens"),
    ("max_tokens float", C, _with(OK, max_tokens=1.5), 400, "max_tokens"),
    ("negative max_tokens", C, _with(OK, max_tokens=-5), 400, "max_tokens"),
    ("zero max_tokens", C, _with(OK, max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", C, _with(OK, max_tokens=10**9), 400, "maximum context length"),
    ("astronomic max_tokens", C, _with(OK, max_tokens=10**40), 400, "max"),
    ("temperature too high", C, _with(OK, temperature=3.0), 400, "temperature"),
    ("negative temperature", C, _with(OK, temperature=-0.1), 400, "temperature"),
    ("temperature as word", C, _with(OK, temperature="hot"), 400, "temperature"),
    ("top_p zero", C, _with(OK, top_p=0), 400, "top_p"),
    ("top_p above one", C, _with(OK, top_p=1.5), 400, "top_p"),
    ("top_k below -1", C, _with(OK, top_k=-2), 400, "top_k"),
    ("boolean as int", C, _with(OK, max_tokens=True), 400, "max_tokens"),
    ("n above 16", C, _with(OK, n=17), 400, "'n'"),
    ("n zero", C, _with(OK, n=0), 400, "'n'"),
    ("prompts x n above 64", C, _with(OK, prompt=["a"] * 5, n=16), 400, "64 choices"),
    ("too many prompts", C, _with(OK, prompt=["a"] * 65), 400, "at most 64"),
    ("batch with an empty prompt", C, _with(OK, prompt=["a", ""]), 400, "must not be empty"),
    ("best_of", C, _with(OK, best_of=3), 400, "best_of"),
    ("logprobs above 20", C, _with(OK, logprobs=21), 400, "logprobs"),
    ("logprobs as boolean", C, _with(OK, logprobs=True), 400, "logprobs"),
    ("echo not boolean", C, _with(OK, echo="yes"), 400, "echo"),
    ("presence_penalty above 2", C, _with(OK, presence_penalty=2.5), 400, "presence_penalty"),
    ("repetition_penalty zero", C, _with(OK, repetition_penalty=0), 400, "repetition_penalty"),
    ("logit_bias out of vocabulary", C, _with(OK, logit_bias={"99999999": 10}), 400, "outside the vocabulary"),
    ("logit_bias above 100", C, _with(OK, logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias key not a token id", C, _with(OK, logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias over 300 ids", C, _with(OK, logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias"),
    ("unknown field", C, _with(OK, foo=1), 400, "Unrecognized request argument supplied: foo"),
    ("wrong model", C, _with(OK, model="gpt-4"), 404, "does not exist"),
    ("empty model", C, _with(OK, model=""), 400, "model"),
    ("empty prompt", C, _with(OK, prompt=""), 400, "must not be empty"),
    ("empty token list", C, _with(OK, prompt=[]), 400, "must not be empty"),
    ("prompt wrong type", C, _with(OK, prompt={"text": "hi"}), 400, "prompt"),
    ("out-of-vocab token ids", C, _with(OK, prompt=[1, 2, 99999999]), 400, "outside the vocabulary"),
    ("negative token id", C, _with(OK, prompt=[5, -1]), 400, "outside the vocabulary"),
    ("mixed token list", C, _with(OK, prompt=[1, "a"]), 400, "prompt"),
    ("oversized prompt", C, _with(OK, prompt="hello world " * 400), 400, "maximum context length"),
    ("stop list too long", C, _with(OK, stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("non-string stop", C, _with(OK, stop=[1, 2]), 400, "stop"),
    ("empty stop string", C, _with(OK, stop=[""]), 400, "stop"),
    ("stop_token_ids out of vocab", C, _with(OK, stop_token_ids=[10**7]), 400, "stop_token_ids"),
    ("negative seed", C, _with(OK, seed=-1), 400, "seed"),
    ("stream not boolean", C, _with(OK, stream="yes"), 400, "stream"),
    ("stream_options without stream", C, _with(OK, stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream_options wrong type", C, _with(OK, stream=True, stream_options={"include_usage": "x"}), 400,
     "include_usage"),
    ("empty messages", CH, _with(OK_CHAT, messages=[]), 400, "messages"),
    ("messages not a list", CH, _with(OK_CHAT, messages="hi"), 400, "messages"),
    ("unknown role", CH, _with(OK_CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("missing content", CH, _with(OK_CHAT, messages=[{"role": "user"}]), 400, "content"),
    ("image content", CH, _with(OK_CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "images"),
    ("top_logprobs without logprobs", CH, _with(OK_CHAT, top_logprobs=2), 400, "requires 'logprobs': true"),
    ("top_logprobs above 20", CH, _with(OK_CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("tools with 'auto' and no parser", CH, _with(OK_CHAT, tools=[{"type": "function", "function": {"name": "f"}}]),
     400, "--tool-call-parser"),
    ("tool_choice names no tool", CH, _with(OK_CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                                            tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "not in 'tools'"),
    ("tool_choice without tools", CH, _with(OK_CHAT, tool_choice="required"), 400, "needs 'tools'"),
    ("a tool named twice", CH, _with(OK_CHAT, tools=[{"type": "function", "function": {"name": "f"}}] * 2,
                                     tool_choice="required"), 400, "twice"),
    ("a tool name with spaces", CH, _with(OK_CHAT, tools=[{"type": "function", "function": {"name": "f g"}}],
                                          tool_choice="required"), 400, "name"),
    ("forced call and a response_format", CH, _with(OK_CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                                                    tool_choice="required", response_format={"type": "json_object"}),
     400, "cannot be combined"),
    ("tool message without its call id", CH, _with(OK_CHAT, messages=[{"role": "tool", "content": "4"}]), 400,
     "tool_call_id"),
    ("functions", CH, _with(OK_CHAT, functions=[{"name": "f"}]), 400, "functions"),
    ("unknown response_format", CH, _with(OK_CHAT, response_format={"type": "xml"}), 400, "response_format"),
    ("json_schema without a schema", CH, _with(OK_CHAT, response_format={"type": "json_schema"}), 400,
     "'json_schema' exactly when"),
    ("json_schema that cannot compile", C, _with(OK, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}), 400, "json_schema cannot be compiled"),
    ("regex that cannot compile", C, _with(OK, structured_outputs={"regex": "("}), 400, "regex cannot be compiled"),
    ("two structured kinds", C, _with(OK, structured_outputs={"regex": "a", "choice": ["b"]}), 400, "exactly one"),
    ("empty choice list", C, _with(OK, structured_outputs={"choice": []}), 400, "choice"),
    ("unknown structured key", C, _with(OK, structured_outputs={"xml": "a"}), 400, "xml"),
    ("response_format and structured_outputs", CH, _with(OK_CHAT, response_format={"type": "json_object"},
                                                         structured_outputs={"regex": "a"}), 400, "not both"),
    ("chat n=17", CH, _with(OK_CHAT, n=17), 400, "'n'"),
    ("chat oversized max_completion_tokens", CH, _with(OK_CHAT, max_completion_tokens=5000), 400,
     "maximum context length"),
]


def test_hostile_requests_get_clear_4xx(server, reference):
    assert len(HOSTILE) >= 20
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, path, body, status, words in HOSTILE:
            if isinstance(body, bytes):
                resp = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                resp = http.post(path, json=body)
            assert resp.status_code == status, (name, resp.text)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert words in err["message"], (name, err["message"])
            assert err["type"] == "invalid_request_error", name
        # routing errors come in the same shape
        assert http.get(C).status_code == 405 and "not allowed" in http.get(C).json()["error"]["message"]
        assert http.post("/v1/nothing", json={}).json()["error"]["message"] == "no route POST /v1/nothing"
    # the server still answers correctly, and nothing is left in flight
    resp = client(server).completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert resp.choices[0].text == reference(reference.tokenizer("def add(a, b):")["input_ids"], 12).text
    assert server.wait_idle()["running"] == 0


# ---- disconnects, 429, auth, shutdown -----------------------------------------------------------------------------


def slow(engine: SpecEngine, delay: float) -> SpecEngine:
    """Make every cycle take at least `delay` s, so a long request is reliably still running when tested."""
    step = engine.step

    def slow_step(batch, *joining, **named):
        time.sleep(delay)
        return step(batch, *joining, **named)

    engine.step = slow_step
    return engine


KEY = {"Authorization": "Bearer sekret"}
LONG = {"model": MODEL, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def small_server(pair):
    """Plain decoding slowed to >= 20 ms per token, one batch slot, one queue place, an API key, and a tokenizer
    without a chat template."""
    app = create_app(slow(make_engine(pair, drafter=False, chat=False), 0.02),
                     ServeConfig(model_name=MODEL, max_model_len=MAX_LEN, max_batch_size=1, max_queue=1,
                                 api_key="sekret"))
    with live(app) as s:
        yield s


def _wait_metric(server, minimum, name, **labels):
    deadline = time.monotonic() + 5
    while server.metric(name, **labels) < minimum:
        assert time.monotonic() < deadline, f"{name}{labels} stayed below {minimum}"
        time.sleep(0.02)


def test_client_dropped_mid_stream_frees_its_slot(small_server):
    s = small_server
    s.wait_idle()
    aborts = s.metric("request_success_total", finished_reason="abort")
    with httpx.Client(timeout=30, headers=KEY) as http:
        with http.stream("POST", f"{s.url}/v1/completions", json=dict(LONG, stream=True)) as resp:
            lines = resp.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(6))
            assert s.health()["running"] == 1
    # the connection is closed: the request is cancelled and its row leaves the batch (300 tokens take >= 6 s)
    start = time.perf_counter()
    assert s.wait_idle(timeout=3)["running"] == 0
    _wait_metric(s, aborts + 1, "request_success_total", finished_reason="abort")
    assert time.perf_counter() - start < 3
    assert s.metric("num_requests_running") == 0


def test_every_choice_of_a_dropped_or_refused_request_frees_its_slot(small_server):
    """n = 2 on one batch slot and one queue place: a client that drops the stream cancels both choices (the
    running one and the waiting one); n = 3 does not fit, and the two choices queued before the 429 are withdrawn."""
    s = small_server
    s.wait_idle()
    aborts = s.metric("request_success_total", finished_reason="abort")
    with httpx.Client(timeout=30, headers=KEY) as http:
        with http.stream("POST", f"{s.url}/v1/completions", json=dict(LONG, stream=True, n=2)) as resp:
            lines = resp.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(6))
            assert s.health()["running"] == 1 and s.health()["waiting"] == 1
    assert s.wait_idle(timeout=3)["running"] == 0
    _wait_metric(s, aborts + 1, "request_success_total", finished_reason="abort")  # the waiting one never ran
    with httpx.Client(timeout=30, headers=KEY) as http:
        resp = http.post(f"{s.url}/v1/completions", json=dict(LONG, n=3))
        assert resp.status_code == 429, resp.text
    h = s.wait_idle(timeout=3)
    assert h["running"] == 0 and h["waiting"] == 0


def test_client_dropped_non_streaming_frees_its_slot(small_server):
    s = small_server
    s.wait_idle()
    aborts = s.metric("request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{s.url}/v1/completions", json=LONG, headers=KEY, timeout=httpx.Timeout(30, read=0.5))
    assert s.wait_idle(timeout=3)["running"] == 0
    _wait_metric(s, aborts + 1, "request_success_total", finished_reason="abort")


def test_full_queue_answers_429_at_once(small_server):
    s = small_server
    s.wait_idle()
    with httpx.Client(timeout=30, headers=KEY) as http:
        with http.stream("POST", f"{s.url}/v1/completions", json=dict(LONG, stream=True)) as running:
            lines = running.iter_lines()  # (a dropped iterator would close the connection)
            next(lines)
            with http.stream("POST", f"{s.url}/v1/completions", json=dict(LONG, stream=True)) as waiting:
                assert s.health()["waiting"] == 1 and s.health()["running"] == 1
                start = time.perf_counter()
                resp = httpx.post(f"{s.url}/v1/completions", headers=KEY, timeout=30,
                                  json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                assert time.perf_counter() - start < 2.0
                assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
                err = resp.json()["error"]
                assert err["type"] == "rate_limit_error" and "capacity" in err["message"]
                assert s.metric("requests_rejected_total", reason="queue_full") >= 1
                assert waiting.status_code == 200
    s.wait_idle(timeout=3)  # both dropped clients left; the slot is free again
    ok = client(s, api_key="sekret").completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1 and ok.model_extra["dflash"]["draft_tokens"] == 0


def test_api_key_and_missing_chat_template(small_server):
    s = small_server
    assert httpx.get(f"{s.url}/v1/models").status_code == 401
    bad = httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert httpx.get(f"{s.url}/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        client(s, api_key="wrong").models.list()
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(s, api_key="sekret").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(s, api_key="sekret").completions.create(model="other", prompt="x")
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):  # the tokenizer is guarded
        assert httpx.post(f"{s.url}{path}", json=body).status_code == 401
        assert httpx.post(f"{s.url}{path}", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_chat_template_kwargs_and_a_continued_final_message(server, reference):
    """vLLM's chat fields: `chat_template_kwargs` reach the template (Qwen3's enable_thinking), and
    `continue_final_message` continues the assistant's last message instead of closing it; the text is what the
    target gives those ids, which /tokenize reports too."""
    c, tok, http = client(server), reference.tokenizer, httpx.Client(timeout=30)
    ask = [{"role": "user", "content": "write add"}]
    plain = tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=True, return_dict=False)
    quiet = tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=True, return_dict=False,
                                    enable_thinking=False)
    assert len(quiet) > len(plain)
    resp = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert resp.usage.prompt_tokens == len(quiet) and resp.choices[0].message.content == reference(quiet, 12).text
    continued = ask + [{"role": "assistant", "content": "def add(a, b):"}]
    ids = tok.apply_chat_template(continued, continue_final_message=True, tokenize=True, return_dict=False)
    assert tok.decode(ids).endswith("def add(a, b):")  # the message left open: no end of turn after it
    body = {"add_generation_prompt": False, "continue_final_message": True}
    resp = c.chat.completions.create(model=MODEL, messages=continued, max_tokens=12, temperature=0, extra_body=body)
    assert resp.usage.prompt_tokens == len(ids) and resp.choices[0].message.content == reference(ids, 12).text
    assert http.post(f"{server.url}/tokenize", json={"messages": continued, **body}).json()["tokens"] == list(ids)
    kwargs = {"messages": ask, "chat_template_kwargs": {"enable_thinking": False}}
    assert http.post(f"{server.url}/tokenize", json=kwargs).json()["tokens"] == list(quiet)
    chat = {"model": MODEL, "messages": continued, "max_tokens": 2}
    for body, says in (({"continue_final_message": True}, "add_generation_prompt"),
                       ({"messages": ask, "continue_final_message": True, "add_generation_prompt": False},
                        "the assistant's"),
                       ({"chat_template_kwargs": {"tokenize": False}}, "cannot set 'tokenize'"),
                       ({"chat_template_kwargs": {"messages": []}}, "cannot set 'messages'"),
                       ({"chat_template_kwargs": [1]}, "chat_template_kwargs")):
        for path, base in (("/v1/chat/completions", chat), ("/tokenize", {"messages": continued})):
            resp = http.post(f"{server.url}{path}", json={**base, **body})
            assert resp.status_code == 400 and says in resp.json()["error"]["message"], (path, body, resp.text)


def test_min_p_reaches_the_sampler(server, reference):
    """vLLM's min_p: a seeded request's text is the engine's with the same min-p (whose distribution
    tests/test_sampling.py and tests/test_gumbel.py check against the target's); out of [0, 1] a 400."""
    c, tok = client(server), reference.tokenizer
    ids = tok("def add(a, b):")["input_ids"]
    texts = {}
    for min_p in (0.0, 0.95):
        served = c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=24, temperature=1.0, seed=7,
                                      extra_body={"min_p": min_p})
        texts[min_p] = served.choices[0].text
        assert texts[min_p] == reference(ids, 24, temperature=1.0, seed=7, min_p=min_p).text
    assert texts[0.0] != texts[0.95]
    for bad in (1.5, -0.1, "0.1"):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 2, "min_p": bad})
        assert resp.status_code == 400 and "min_p" in resp.json()["error"]["message"], resp.text


def test_min_tokens_holds_back_stops(server, reference):
    """vLLM's min_tokens: a stop id the greedy text holds early does not end it before min_tokens tokens; the
    text is the engine's with the same settings (tests/test_min_tokens.py checks it against transformers')."""
    c, tok = client(server), reference.tokenizer
    ids = tok("import os\n")["input_ids"]
    free = reference(ids, 16)
    stop = free.token_ids[2]
    short = c.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0,
                                 extra_body={"stop_token_ids": [stop]})
    held = c.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0,
                                extra_body={"stop_token_ids": [stop], "min_tokens": 10})
    assert short.usage.completion_tokens <= 3 < 10 <= held.usage.completion_tokens
    expected = reference(ids, 16, stop_token_ids=(tok.eos_token_id, stop), min_tokens=10)
    assert held.choices[0].text == expected.text
    for bad, says in ((-1, "min_tokens"), (17, "min_tokens must be")):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 16, "min_tokens": bad})
        assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text


def test_allowed_token_ids_reach_the_engine(server, reference):
    """vLLM's allowed_token_ids: the text is the engine's with the same ids allowed (tests/test_min_tokens.py
    checks that against transformers'), every token among them; ids outside the vocabulary or none: 400."""
    c, tok = client(server), reference.tokenizer
    ids = tok("def add(a, b):")["input_ids"]
    free = reference(ids, 12)
    allowed = sorted(set(free.token_ids[3:]) | {tok.eos_token_id, 10, 11, 12})
    got = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                               extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    expected = reference(ids, 12, allowed_token_ids=tuple(allowed))
    assert got.choices[0].text == expected.text != free.text
    assert {int(t.split(":")[1]) for t in got.choices[0].logprobs.tokens} <= set(allowed)
    for bad in ([10 ** 6], [], [-1]):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 2, "allowed_token_ids": bad})
        assert resp.status_code == 400 and "allowed_token_ids" in resp.json()["error"]["message"], resp.text


def test_bad_words_reach_the_engine(server, reference):
    """vLLM's bad_words: each word banned as written and after a space (where that is another token sequence of the
    same length); the text is the engine's with those sequences banned (tests/test_min_tokens.py checks that against
    transformers'); empty, blank or too many words: 400."""
    c, tok = client(server), reference.tokenizer
    ids = tok("def add(a, b):")["input_ids"]
    free = reference(ids, 12)
    word = next(tok.decode([t]) for t in free.token_ids  # a token of the output that is a word on its own
                if tok.decode([t]).isalnum() and tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    banned = [tuple(tok.encode(word, add_special_tokens=False))]
    spaced = tuple(tok.encode(" " + word, add_special_tokens=False))
    if len(spaced) == len(banned[0]) and spaced[0] != banned[0][0]:
        banned.append(spaced)
    got = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                               extra_body={"bad_words": ["  " + word]})
    expected = reference(ids, 12, bad_words=tuple(banned))
    assert got.choices[0].text == expected.text != free.text
    for bad in ([""], ["   "], ["x"] * 65, "x"):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 2, "bad_words": bad})
        assert resp.status_code == 400 and "bad_words" in resp.text, resp.text


def test_priority_needs_priority_scheduling(server):
    """vLLM's `priority`: 0 (or none) under the default first-come-first-served policy; any other value is a 400
    naming --scheduling-policy (tests/test_serve_units.py orders a queue by priority)."""
    ok = httpx.post(f"{server.url}/v1/completions", timeout=30,
                    json={"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": 0})
    assert ok.status_code == 200, ok.text
    for bad in (3, -1, 2**31, "1"):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": bad})
        assert resp.status_code == 400 and "priority" in resp.text, resp.text
    assert "scheduling-policy" in httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "priority": 3}).json()["error"]["message"]


def test_skip_special_tokens_reaches_the_text(server, reference):
    c, tok = client(server), reference.tokenizer
    mask = tok.convert_tokens_to_ids("<|mask|>")
    texts = [c.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0, logit_bias={str(mask): 100},
                                  extra_body={"skip_special_tokens": skip}).choices[0].text for skip in (True, False)]
    assert texts == ["", "<|mask|>" * 6]
    # vLLM's spaces_between_special_tokens: its fast-tokenizer detokenizer, like transformers 5's decode, ignores it
    for spaces in (True, False):
        text = c.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0, logit_bias={str(mask): 100},
                                    extra_body={"skip_special_tokens": False,
                                                "spaces_between_special_tokens": spaces}).choices[0].text
        assert text == tok.decode([mask] * 6, skip_special_tokens=False) == "<|mask|>" * 6
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "spaces_between_special_tokens": "no"})
    assert resp.status_code == 400 and "spaces_between_special_tokens" in resp.text, resp.text


def test_tokens_as_token_ids_in_log_probabilities(server, reference):
    """vLLM's return_tokens_as_token_ids: log-probabilities name each token (chosen and alternatives) "token_id:<id>",
    the figures unchanged; completions, chat and a stream."""
    c, tok = client(server), reference.tokenizer
    ids = tok("def add(a, b):")["input_ids"]
    expected = reference(ids, 8, logprobs=2)
    named = [f"token_id:{t}" for t in expected.token_ids]
    extra = {"return_tokens_as_token_ids": True}
    plain = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=2)
    got = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=2, extra_body=extra)
    lp = got.choices[0].logprobs
    assert lp.tokens == named and lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    for top, e in zip(lp.top_logprobs, expected.logprobs):
        assert set(top) == {f"token_id:{t}" for t, _ in e.top} | {f"token_id:{e.token}"}
    streamed = [t for ch in c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=2,
                                                 stream=True, extra_body=extra)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == named
    messages = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                     top_logprobs=2, extra_body=extra).choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") and e.bytes == list(e.token.encode()) for e in chat)
    assert all(t.token.startswith("token_id:") for e in chat for t in e.top_logprobs)


def test_truncate_prompt_tokens_keeps_each_prompts_last_tokens(server, reference):
    """vLLM's truncate_prompt_tokens: the text is what the target gives the prompt's last k tokens (a string's, a
    token list's, a conversation's as rendered), echo shows them; -1 keeps max_model_len."""
    c, tok, http = client(server), reference.tokenizer, httpx.Client(timeout=30)
    text = "import os\nimport sys\n\ndef main(argv):\n    "
    ids = tok(text)["input_ids"]
    resp = c.completions.create(model=MODEL, prompt=[text, ids], max_tokens=8, temperature=0, echo=True,
                                extra_body={"truncate_prompt_tokens": 6})
    for choice in resp.choices:
        assert choice.text == tok.decode(ids[-6:]) + reference(ids[-6:], 8).text
    assert resp.usage.prompt_tokens == 12
    long = (ids * 40)[:MAX_LEN + 10]  # longer than the context: refused unless truncated
    body = {"model": MODEL, "prompt": long, "max_tokens": 4, "temperature": 0}
    assert http.post(f"{server.url}/v1/completions", json=body).status_code == 400
    for keep, kept in ((MAX_LEN - 4, MAX_LEN - 4), (-1, MAX_LEN)):
        resp = http.post(f"{server.url}/v1/completions", json={**body, "truncate_prompt_tokens": keep})
        if kept + 4 > MAX_LEN:  # the whole context kept leaves no room for max_tokens
            assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"]
            continue
        assert resp.json()["usage"]["prompt_tokens"] == kept
        assert resp.json()["choices"][0]["text"] == reference(long[-kept:], 4).text
    ask = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write add"}]
    rendered = tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=True, return_dict=False)
    chat = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5 and chat.choices[0].message.content == reference(rendered[-5:], 8).text
    for bad in (0, -2, "5"):
        resp = http.post(f"{server.url}/v1/completions", json={**body, "truncate_prompt_tokens": bad})
        assert resp.status_code == 400 and "truncate_prompt_tokens" in resp.json()["error"]["message"], resp.text


def test_tokenize_gives_the_ids_the_generation_routes_run(server, reference):
    """vLLM's /tokenize and /detokenize: a prompt's ids are the tokenizer's and the ones /v1/completions counts; a
    conversation's (tools included) the chat template's and the ones /v1/chat/completions counts; detokenize inverts."""
    tok = reference.tokenizer
    http = httpx.Client(timeout=30)
    text = "def add(a, b):\n    return"
    got = http.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    ids = tok(text)["input_ids"]
    assert got == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                   "token_strs": tok.convert_ids_to_tokens(ids)}
    served = client(server).completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    assert served.usage.prompt_tokens == got["count"]
    bare = http.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    counts = []
    for extra in ({}, {"add_generation_prompt": False}, {"tools": tools}):
        got = http.post(f"{server.url}/tokenize", json={"messages": messages, **extra}).json()
        counts.append(got["count"])
        rendered = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        want = tok.apply_chat_template(rendered, add_generation_prompt=extra.get("add_generation_prompt", True),
                                       tokenize=True, return_dict=False, tools=extra.get("tools"))
        assert got["tokens"] == list(want) and got["count"] == len(want), extra
    assert counts[1] < counts[0] < counts[2]  # the generation prompt and the tools are rendered
    chat = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == http.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]

    back = http.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": tok.decode(ids)} and back["prompt"].endswith(text)
    assert http.post(f"{server.url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}

    for path, body, status, says in (
            ("/tokenize", {"prompt": ""}, 400, "at least 1 character"),
            ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
            ("/tokenize", {"prompt": "x", "temperature": 0}, 400, "Unrecognized request argument"),
            ("/tokenize", {"messages": []}, 400, "messages"),
            ("/tokenize", {"messages": [{"role": "user"}]}, 400, "content"),
            ("/tokenize", [1, 2], 400, "JSON object"),
            ("/detokenize", {"tokens": [10 ** 6]}, 400, "outside the vocabulary"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
            ("/detokenize", {"tokens": "1 2"}, 400, "list"),
            ("/detokenize", {}, 400, "tokens")):
        resp = http.post(f"{server.url}{path}", json=body)
        assert resp.status_code == status and says in resp.json()["error"]["message"], (path, body, resp.text)


def test_graceful_shutdown_finishes_in_flight_streams(pair):
    app = create_app(slow(make_engine(pair, drafter=False), 0.02), ServeConfig(model_name=MODEL, max_model_len=MAX_LEN))
    s = Live(app)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{s.url}/v1/completions", json=body) as resp:
            it = resp.iter_lines()
            lines = [next(it)]
            s.server.should_exit = True  # what SIGTERM does: stop accepting, let in-flight requests finish
            lines.extend(it)
    s.thread.join(timeout=30)
    assert not s.thread.is_alive() and not s.scheduler.alive
    data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" in lines[-2:]
    assert data[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(d["choices"][0]["text"]) > 0 for d in data) >= 30  # the whole completion came through


def test_loadtest_script_against_live_server(server, tmp_path, capsys):
    from flashdraft.serve.loadtest import main

    out = tmp_path / "lt.json"
    assert main(["--url", server.url, "--concurrency", "1,4", "--requests", "4", "--max-tokens", "4",
                 "--warmup", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["concurrency"] for row in report["levels"]] == [1, 4]
    assert all(row["output_tokens"] == 16 and row["mean_tau"] >= 1.0 for row in report["levels"])
    assert "out tok/s" in capsys.readouterr().out
