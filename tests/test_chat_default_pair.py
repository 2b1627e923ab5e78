"""/v1/chat/completions on the shipped default pair, through the real `openai` client.

The default target is a code-completion model; its chat template (tokenizer_config.json) renders the last user
message's content as the prompt (plus any assistant messages after it, a partial answer to continue) and ignores
system and earlier messages, with nothing added for the generation prompt. So a chat request must answer exactly
what /v1/completions answers for the bare code prompt, which is the target's own greedy continuation.
The server is built the way `flashdraft serve` builds it (`build_engine` from the CLI's own arguments) and runs
in a thread on a loopback port.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from flashdraft.cli import _encode  # noqa: E402
from flashdraft.loading import DEFAULT_TARGET  # noqa: E402
from flashdraft.serve.app import ServeConfig, create_app  # noqa: E402
from flashdraft.serve.cli import add_serve_parser, build_engine  # noqa: E402

PROMPT = "def fib(n):"
MAX_TOKENS = 16
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--device", "cpu", "--threads", "1"])
    engine, name = build_engine(args)  # no --target / --draft: the shipped default pair
    app = create_app(engine, ServeConfig(model_name=name, max_batch_size=4, max_queue=8, threads=1))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield url, name
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected():
    """The target's own greedy continuation of PROMPT, by transformers alone."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return tok, ids[0].tolist(), new, tok.decode(new, skip_special_tokens=True)


def test_template_renders_the_last_user_message(expected):
    tok, ids, _, _ = expected
    assert tok.chat_template, "the shipped target must have a chat template"
    render = lambda msgs, **kw: tok.apply_chat_template(msgs, tokenize=False, **kw)  # noqa: E731
    assert render(MESSAGES, add_generation_prompt=True) == PROMPT == render(MESSAGES, add_generation_prompt=False)
    earlier = [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "x"}] + MESSAGES
    assert render(earlier, add_generation_prompt=True) == PROMPT
    # an assistant message after the last user message is a partial answer: the model continues it
    assert render(MESSAGES + [{"role": "assistant", "content": "\n    if n"}]) == PROMPT + "\n    if n"
    assert render([{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "f():"}]}]) \
        == "def f():"
    with pytest.raises(Exception, match="needs a user message"):
        render([{"role": "system", "content": "hi"}])
    chat_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(chat_ids) == ids
    # `flashdraft generate --chat` encodes the same ids as the plain prompt
    assert _encode(tok, PROMPT, chat=True) == _encode(tok, PROMPT, chat=False) == ids


def test_chat_equals_completion_and_target_greedy(server, expected):
    url, name = server
    _, ids, new, text = expected
    assert text, "the target's greedy continuation should not be empty"
    chat = client(url).chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    completion = client(url).completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    content = chat.choices[0].message.content
    assert content and content == completion.choices[0].text == text
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens == len(ids)
    assert chat.usage.completion_tokens == completion.usage.completion_tokens == len(new)
    assert chat.choices[0].finish_reason == completion.choices[0].finish_reason
    assert chat.model_extra["dflash"]["drafts"] >= 1  # served by DFlash, not plain decoding


def test_streaming_chat(server, expected):
    url, name = server
    _, ids, new, text = expected
    chunks = list(client(url).chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == len(new)


def test_chat_without_user_message_is_a_clear_400(server):
    url, name = server
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                   json={"model": name, "messages": [{"role": "system", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 400 and "needs a user message" in r.json()["error"]["message"]
