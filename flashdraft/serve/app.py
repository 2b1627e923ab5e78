"""The HTTP layer: an OpenAI-compatible FastAPI app in front of the scheduler.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with
`stream_options.include_usage`), GET /health, GET /metrics (Prometheus), GET /openapi.json (the API's schema).
Request flow: read the raw body (at most `max_body_bytes`, within `body_timeout` seconds: else 413 / 408, and the
connection is closed) -> in a worker thread, never on the event loop: `protocol.parse_body` (UTF-8, JSON, every
string encodable, finite numbers, strict pydantic, unsupported options), model name, a prompt-size check by bytes
(a prompt longer than `max_prompt_bytes` cannot fit in the context, so it is refused before it is tokenized),
tokenization (chat: the target's chat template), context-length checks -> `Scheduler.submit` (429 when the queue
is full) -> events from the request's asyncio queue become one JSON body or SSE chunks. Detokenization happens in
the scheduler's thread (the engine's incremental detokenizer), so the event loop only moves bytes: one huge prompt
delays neither the running streams nor /health. Every response carries its acceptance statistics in a `dflash`
field (on the final chunk when streaming). A client that disconnects, streaming or not, has its request cancelled
at once, which frees its batch slot. Every error, FastAPI's own included (404 route, 405 method), is answered in
the OpenAI shape; validation errors are 400, not 422; strings a client sent are clipped before an error message
echoes them. Optional Bearer key on /v1/*.

Shutdown (`Server.drain`, called by `cli.uvicorn_server` on SIGINT/SIGTERM before uvicorn waits for connections,
and at the latest by the lifespan's end): /health turns 503 "draining", bodies still being read are answered
503, new requests get 503, in-flight ones get `drain_timeout` seconds to finish, then the rest are cancelled with
an error (a stream gets an error event and `data: [DONE]`, a plain request a 503). A request task cancelled by the
server itself (uvicorn past its graceful timeout) is answered the same way by `_ExpectedCancellation`, without a
traceback.

What this module does not know about: how batching, drafting or verification work (the scheduler and the engine),
model loading and command-line options (`cli.py`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from flashdraft import memory
from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.engine.detokenize import bad_word_ids
from flashdraft.engine.logprobs import TokenLogprob
from flashdraft.engine.noise import NOISE_VERSION
from flashdraft.memory import engine_bytes_per_position
from flashdraft.serve import protocol, tools
from flashdraft.serve.metrics import Metrics
from flashdraft.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeChatRequest, clip)
from flashdraft.serve.scheduler import Failure, NotPrioritized, QueueFull, Scheduler, SchedulerClosed, TooLarge

log = logging.getLogger("flashdraft.serve")

SHUTDOWN_MESSAGE = "the server shut down before the request finished"


@dataclass
class ServeConfig:
    model_name: str = "flashdraft"
    max_model_len: int | None = None  # default: the target's max_position_embeddings
    max_batch_size: int = 16
    max_queue: int = 64
    max_prefill_tokens: int = 8192
    api_key: str | None = None
    drain_timeout: float = 30.0
    default_completion_tokens: int = 16  # OpenAI's default max_tokens for /v1/completions
    threads: int | None = None  # CPU threads of the engine's thread (default: 1 on CPU)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies are a 413
    body_timeout: float = 30.0  # seconds a client gets to send the whole body (else 408)
    max_prompt_bytes: int | None = None  # default: max_model_len x the bytes of the longest vocabulary entry
    tokenizer_workers: int = 2  # threads that parse and tokenize requests (off the event loop)
    kv_cache_bytes: int | None = None  # target + drafter K/V budget; admission waits beyond it (None: no bound)
    tool_call_parser: str | None = None  # how tool_choice "auto" reads calls out of text (`tools.PARSERS`)
    scheduling_policy: str = "fcfs"  # waiting requests: "fcfs", or "priority" by each request's `priority` (vLLM's)


def system_fingerprint(engine: SpecEngine) -> str | None:
    """`system_fingerprint` of every response: the sampling noise's version under the seed-reproducible sampler
    (a seeded request's text changes when it does, `noise.NOISE_VERSION`), None under rejection sampling, whose
    seeded text is not reproducible across batches anyway."""
    return f"flashdraft-noise{NOISE_VERSION}" if engine.config.sampler == "gumbel" else None


class Server:
    """What the routes share: engine facts, the scheduler, metrics, the tokenizer threads."""

    def __init__(self, engine: SpecEngine, config: ServeConfig):
        if engine.tokenizer is None:
            raise ValueError("serving needs a tokenizer: the target has none")
        for name in ("max_body_bytes", "tokenizer_workers"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
        if not config.body_timeout > 0 or not config.drain_timeout >= 0:
            raise ValueError("body_timeout must be > 0 and drain_timeout >= 0")
        if config.api_key is not None and not config.api_key.strip():
            raise ValueError("api_key is empty: that would leave the server open; pass None to serve without a key")
        self.engine, self.config, self.tokenizer = engine, config, engine.tokenizer
        limit = engine.max_positions
        self.max_model_len = min(x for x in (config.max_model_len, limit) if x) if (config.max_model_len or limit) \
            else 1 << 30
        self.vocab_size = engine.target.vocab_size
        self.max_prompt_bytes = config.max_prompt_bytes or self.max_model_len * _longest_token_bytes(self.tokenizer)
        self.metrics = Metrics(config.model_name)
        self.kv_cache_positions = self._kv_cache_positions(config.kv_cache_bytes)
        self.scheduler = Scheduler(engine, config.max_batch_size, config.max_queue, config.max_prefill_tokens,
                                   self.metrics, threads=config.threads, kv_cache_positions=self.kv_cache_positions,
                                   policy=config.scheduling_policy)
        self.pool = ThreadPoolExecutor(config.tokenizer_workers, thread_name_prefix="flashdraft-tokenize")
        self.eos_ids = engine.eos_token_ids
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        # names chat_template_kwargs may not use: apply_chat_template's own parameters, and the template's messages
        self.template_parameters = {name for name, p in inspect.signature(self.tokenizer.apply_chat_template)
                                    .parameters.items() if p.kind is not p.VAR_KEYWORD} | {"messages"}
        self.created = int(time.time())
        self.fingerprint = system_fingerprint(engine)
        # a token id's string in log-probability responses (vLLM's convention: the token decoded alone)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: self.tokenizer.decode([token]))
        self.draining = False
        self._closing: asyncio.Event | None = None  # set when draining starts (created on the serving loop)

    def _kv_cache_positions(self, budget: int | None) -> int | None:
        """Cache positions the budget holds (None: unbounded); logs the projection's figure for this pair."""
        if budget is not None and budget < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1 or None, got {budget}")
        target_bytes, drafter_bytes = engine_bytes_per_position(self.engine)
        log.info("%s%s", memory.describe(target_bytes, drafter_bytes, budget, self.max_model_len,
                                         self.engine.scratch_slots, self.engine.config.kv_page_size,
                                         memory.kv_shares(self.engine)),
                 "" if budget else " (no --kv-cache-memory: only --max-batch-size bounds the batch)")
        return None if budget is None else memory.positions_for_budget(budget, target_bytes, drafter_bytes)

    # ---- the body: bounded in size and time -------------------------------------------------------------------

    def closing(self) -> asyncio.Event:
        if self._closing is None:
            self._closing = asyncio.Event()
        return self._closing

    async def read_body(self, request: Request) -> bytes:
        """The whole body, or APIError 413 (too large: refused from Content-Length before reading, or once the
        count passes the limit), 408 (not complete within body_timeout), 503 (the server began draining)."""
        cfg = self.config
        too_large = (f"request body is larger than the server's limit of {cfg.max_body_bytes} bytes "
                     "(--max-body-bytes)")
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "invalid Content-Length header")
            if int(length) > cfg.max_body_bytes:
                self.metrics.rejected("body_too_large")
                if int(length) <= 4 * cfg.max_body_bytes:  # read and drop it (within the timeout), so that a client
                    try:  # that sends its whole body before reading gets the 413 rather than a reset connection
                        await asyncio.wait_for(self._discard(request), cfg.body_timeout)
                    except (asyncio.TimeoutError, ClientDisconnect):
                        pass
                raise APIError(413, too_large, code="request_too_large")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cfg.max_body_bytes:
                    self.metrics.rejected("body_too_large")
                    raise APIError(413, too_large, code="request_too_large")
                chunks.append(chunk)
            return b"".join(chunks)

        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        reader, closing = asyncio.ensure_future(read()), asyncio.ensure_future(self.closing().wait())
        try:
            done, _ = await asyncio.wait([reader, closing], timeout=cfg.body_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not reader.done():
                reader.cancel()
        if reader in done:
            return reader.result()  # the body, or the reader's APIError / ClientDisconnect
        if closing in done:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        self.metrics.rejected("body_timeout")
        raise APIError(408, f"the request body did not arrive within {cfg.body_timeout:g} s (--body-timeout)",
                       code="request_timeout")

    @staticmethod
    async def _discard(request: Request) -> None:
        async for _ in request.stream():
            pass

    # ---- request -> (prompt ids, SamplingParams), in a worker thread ---------------------------------------------

    async def prepare(self, raw: bytes, chat: bool):
        """(request, the prompts' ids, the choices) of a raw body (`_prepare`); parsing and tokenizing run in the
        worker threads."""
        return await self.run_in_pool(self._prepare, raw, chat)

    def _prepare(self, raw: bytes, chat: bool):
        """The choices are (prompt index, SamplingParams), choice i * n + j for prompt i: every prompt of a batched
        completions request, each `n` times."""
        req = protocol.parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
        self.check_model(req.model)
        keep = req.truncate_prompt_tokens
        keep = self.max_model_len if keep == -1 else keep  # vLLM's truncation: each prompt's last `keep` tokens
        if chat:
            ids = self.chat_prompt(req)
            prompts = [ids[-keep:] if keep else ids]
            params = [self.sampling_params(req, len(prompts[0]), req.max_new_tokens, None)]
        else:
            prompts = [self.completion_prompt(p, keep) for p in req.prompt]
            # max_tokens 0 (with echo): one token is generated and not returned; its cycle scores the prompt
            max_tokens = req.max_tokens or (None if req.max_tokens is None else 1)
            params = [self.sampling_params(req, len(p), max_tokens, self.config.default_completion_tokens)
                      for p in prompts]
        return req, prompts, [(i, choice_params(p, j)) for i, p in enumerate(params) for j in range(req.n or 1)]

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"The model {clip(name)!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")

    def check_prompt_bytes(self, size: int, param: str) -> None:
        if size > self.max_prompt_bytes:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                                f"{size} bytes, more than the {self.max_prompt_bytes} bytes that many tokens can hold "
                                "(refused before tokenizing)", param=param, code="context_length_exceeded")

    def completion_prompt(self, prompt: str | list[int], keep: int | None = None) -> list[int]:
        """A prompt's ids (its last `keep`, where given), or APIError naming what is wrong with it."""
        if keep and not isinstance(prompt, str):
            prompt = prompt[-keep:]
        if isinstance(prompt, str):
            self.check_prompt_bytes(len(prompt.encode("utf-8")), "prompt")
            try:
                ids = list(self.tokenizer(prompt)["input_ids"])
            except Exception as e:  # the tokenizer refusing a text is the client's problem, not a 500
                raise APIError(400, f"the prompt could not be tokenized: {clip(str(e), 200)}", param="prompt") \
                    from None
            if not ids:
                raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
            return ids[-keep:] if keep else ids
        if len(prompt) > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                                f"{len(prompt)} tokens", param="prompt", code="context_length_exceeded")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"'prompt' has token ids outside the vocabulary [0, {self.vocab_size}): "
                                f"{clip(bad[:5])}", param="prompt")
        return list(prompt)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if req.effective_tool_choice == "auto" and self.config.tool_call_parser is None:
            raise APIError(400, "tool_choice 'auto' (the default with 'tools') reads calls out of the model's text: "
                                "start the server with --tool-call-parser, or send tool_choice 'required', a "
                                "function or 'none'", param="tool_choice")
        return self.render_chat(req)

    def bad_word_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """vLLM's reading of `bad_words` (`detokenize.bad_word_ids`); a word that is no tokens is a 400."""
        try:
            return bad_word_ids(self.tokenizer, words)
        except ValueError as e:
            raise APIError(400, f"'bad_words': {e}", param="bad_words") from None

    def render_chat(self, req: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The ids of a conversation (messages, tools, generation prompt) through the chat template."""
        if not self.has_chat_template:
            raise APIError(400, f"the model '{self.config.model_name}' has no chat template, so /v1/chat/completions "
                                "cannot format messages; use /v1/completions with a plain prompt", param="messages",
                           code="no_chat_template")
        # the template renders every message's content at least once: a lower bound of the prompt's size
        self.check_prompt_bytes(sum(m.text_bytes for m in req.messages), "messages")
        messages = tools.template_messages([m.model_dump(exclude_none=True) for m in req.messages])
        extra = req.chat_template_kwargs or {}
        taken = sorted(set(extra) & self.template_parameters)
        if taken:
            raise APIError(400, f"'chat_template_kwargs' cannot set {clip(taken[0])!r}, a parameter of the template "
                                "call itself (use the request field, where there is one)",
                           param="chat_template_kwargs")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                     continue_final_message=req.continue_final_message,
                                                     tokenize=True, return_dict=False, tools=req.tool_dicts() or None,
                                                     **extra)
        except Exception as e:  # jinja raises for conversations the template refuses (e.g. role order)
            raise APIError(400, f"the chat template refused these messages: {clip(str(e), 200)}",
                           param="messages") from None
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        if not ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        return list(ids)

    # ---- /tokenize and /detokenize (vLLM's), in a worker thread ---------------------------------------------------

    async def run_in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def tokenize(self, raw: bytes) -> dict:
        """The ids the generation routes would run for a prompt or a conversation, without running them: `count`
        against `max_model_len` tells a client whether (and how much of) a request fits."""
        req = protocol.parse_body(raw, protocol.tokenize_request_model)
        if req.model is not None:
            self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = self.render_chat(req)
        else:
            self.check_prompt_bytes(len(req.prompt.encode("utf-8")), "prompt")
            try:
                ids = list(self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
            except Exception as e:
                raise APIError(400, f"the prompt could not be tokenized: {clip(str(e), 200)}", param="prompt") \
                    from None
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return body

    def detokenize(self, raw: bytes) -> dict:
        req = protocol.parse_body(raw, DetokenizeRequest)
        if req.model is not None:
            self.check_model(req.model)
        bad = [t for t in req.tokens if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"'tokens' has ids outside the vocabulary [0, {self.vocab_size}): {clip(bad[:5])}",
                           param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def sampling_params(self, req, prompt_len: int, max_tokens: int | None, default_max: int | None) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                                f"{prompt_len} tokens, which leaves no room for a completion", param="prompt"
                           if isinstance(req, CompletionRequest) else "messages", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif prompt_len + max_tokens > self.max_model_len:
            param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                                "completion). Reduce the prompt or the completion length.", param=param,
                           code="context_length_exceeded")
        stop_ids = [] if req.ignore_eos else list(self.eos_ids)
        for t in req.stop_token_ids or []:
            if t >= self.vocab_size:
                raise APIError(400, f"'stop_token_ids' has {t}, outside the vocabulary [0, {self.vocab_size})",
                               param="stop_token_ids")
            stop_ids.append(t)
        allowed = req.allowed_token_ids or ()
        if allowed and max(allowed) >= self.vocab_size:
            raise APIError(400, f"'allowed_token_ids' has token id {max(allowed)}, outside the vocabulary [0, "
                                f"{self.vocab_size})", param="allowed_token_ids")
        bias = {int(t): b for t, b in (req.logit_bias or {}).items()}
        if bias and max(bias) >= self.vocab_size:
            raise APIError(400, f"'logit_bias' has token id {max(bias)}, outside the vocabulary [0, "
                                f"{self.vocab_size})", param="logit_bias")
        structured = req.structured_output()
        if structured is not None:
            try:
                self.engine.grammars.check(structured)
            except ValueError as e:
                param = ("tools" if getattr(req, "calls_forced", False) else "structured_outputs"
                         if req.structured_outputs is not None else "response_format")
                raise APIError(400, str(e), param=param) from None
        # the prompt's figures: for completions' echo (its logprobs' alternatives) and vLLM's prompt_logprobs
        echo_top = req.logprobs if isinstance(req, CompletionRequest) and req.echo else None
        top_k = req.top_k or 0
        if top_k < 0 or top_k >= self.vocab_size:  # -1 (vLLM's "off") or a k that keeps every token
            top_k = 0
        try:
            return SamplingParams(
                max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p), top_k=top_k, min_p=float(req.min_p or 0.0),
                min_tokens=req.min_tokens or 0, allowed_token_ids=tuple(allowed),
                bad_words=self.bad_word_ids(req.bad_words or ()),
                stop_token_ids=tuple(dict.fromkeys(stop_ids)), stop_strings=tuple(req.stop or ()), seed=req.seed,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                logprobs=req.num_logprobs,
                prompt_logprobs=max((k for k in (echo_top, req.prompt_logprobs) if k is not None), default=None),
                logit_bias=bias, presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                structured=structured, cache_salt=req.cache_salt)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def submit(self, prompt: list[int], params: SamplingParams, rid: str, priority: int = 0):
        if self.draining:
            self.metrics.rejected("shutting_down")
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            return self.scheduler.submit(prompt, params, rid, priority=priority)
        except QueueFull as e:
            self.metrics.rejected("queue_full")
            raise APIError(429, str(e), code="queue_full") from None
        except TooLarge as e:
            self.metrics.rejected("kv_cache_budget")
            raise APIError(400, str(e), param="max_tokens", code="kv_cache_budget") from None
        except SchedulerClosed as e:
            self.metrics.rejected("shutting_down")
            raise APIError(503, str(e), code="shutting_down") from None
        except NotPrioritized as e:
            raise APIError(400, str(e), param="priority") from None

    def stats(self, result) -> dict:
        return protocol.dflash_stats(result.stats, self.engine.block_size)

    def usage(self, choices, prompt_tokens: int, completion_tokens: int) -> dict:
        """A finished request's usage; with a prefix cache, the prompt tokens it gave: each prompt's first
        choice's (its other choices may find what the first computed)."""
        if self.engine.prefix_cache is None:
            return protocol.usage(prompt_tokens, completion_tokens)
        first = {}
        for choice in choices:
            first.setdefault(choice.prompt_index, choice.cached_tokens)
        return protocol.usage(prompt_tokens, completion_tokens, sum(first.values()))

    # ---- shutdown ------------------------------------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> None:
        """Refuse new work (503), give in-flight requests `timeout` seconds (default: the config's drain_timeout),
        then cancel the rest with an error event. Safe to call more than once."""
        if not self.draining:
            self.draining = True
            self.closing().set()
            busy = self.scheduler.num_running + self.scheduler.num_waiting
            log.info("draining: %d request(s) in flight get up to %g s", busy,
                     self.config.drain_timeout if timeout is None else timeout)
        await asyncio.to_thread(self.scheduler.stop, self.config.drain_timeout if timeout is None else timeout)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _longest_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token stands for (the longest vocabulary entry, special tokens
    included): a prompt of more than max_model_len times this many bytes cannot fit in the context. For byte-level
    BPE each character of an entry is one byte; otherwise a character is at most 4 UTF-8 bytes."""
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # no vocabulary to look at: only the body limit applies
        return 1 << 40
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return max(1, longest if type(decoder).__name__ == "ByteLevel" else 4 * longest)


def _error(e: APIError, headers: dict | None = None) -> Response:
    headers = dict(headers or {})
    if e.status == 429:
        headers["Retry-After"] = "1"
    if e.status in (408, 413):  # the rest of the body is still unread: this connection cannot carry another request
        headers["Connection"] = "close"
    return Response(protocol.error_json(e.body()), status_code=e.status, headers=headers,
                    media_type="application/json")


def _failure(item: Failure) -> APIError:
    return APIError(item.status, item.message, code="shutting_down" if item.status == 503 else None)


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of a prompt's `n` choices: a seeded request's first choice keeps the seed (the same text as with
    n = 1), the others take seeds derived from it; unseeded choices each get a random one (`SpecEngine`)."""
    if j == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + j * 0x9E3779B97F4A7C15) % 2**63)


def _echoed(prompt: list[int], prompt_logprobs) -> list[TokenLogprob] | None:
    """An echoed prompt's entries for the completions API's logprobs: its first token's figures are null."""
    return None if prompt_logprobs is None else [TokenLogprob(prompt[0], None)] + prompt_logprobs[1:]


@dataclass
class _Echo:
    """A completions request's echo for one choice: the prompt's text, its ids, and whether the completion follows
    (max_tokens 0: the prompt alone)."""

    text: str
    prompt: list[int]
    completes: bool


@dataclass
class _Choice:
    """One choice of a request (a prompt's j-th of n) on its way out: its scheduler handle and what its stream has
    sent."""

    index: int
    prompt: list[int]
    echo: _Echo | None
    handle: object = None
    finished: bool = False
    echoed: bool = False
    n_out: int = 0
    pending: list = field(default_factory=list)  # log-probabilities of tokens not yet sent
    sent: int = 0  # log-probabilities sent
    offset: int = 0  # text offset of the next token's (completions' logprobs)
    text: str = ""  # where the output may hold tool calls: the text so far, and how much of it went out as content
    shown: int = 0
    call_id: str | None = None  # a stream's named call, once its first arguments went out
    token_text: Callable[[int], str] | None = None  # a token's string in log-probabilities
    prompt_index: int = 0  # which of the request's prompts
    cached_tokens: int = 0  # of its prompt, those the prefix cache gave (once finished)

    def result_parts(self, result) -> tuple[str, list | None, int, str]:
        """(text, log-probability entries or None, completion tokens, finish reason) of the choice's result, the
        echo included."""
        text, entries, n_out, reason = result.text or "", result.logprobs, len(result.token_ids), result.finish_reason
        if self.echo is not None:
            if not self.echo.completes:
                text, entries, n_out, reason = "", entries and [], 0, "length"
            text = self.echo.text + text
            entries = None if entries is None else _echoed(self.echo.prompt, result.prompt_logprobs) + entries
        return text, entries, n_out, reason


def token_id_text(token: int) -> str:
    """A token's string under vLLM's `return_tokens_as_token_ids`: its id, unambiguous where decoded pieces are not
    (a byte of a split character, tokens that decode alike)."""
    return f"token_id:{token}"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class BearerAuth:
    """Pure ASGI middleware (streams and disconnects pass through untouched): /v1/*, /tokenize and /detokenize need
    `Bearer <api_key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(protocol.GUARDED_PATHS):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                what = "missing" if not header else "invalid"
                await _error(APIError(401, f"{what} API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ExpectedCancellation:
    """Pure ASGI middleware: a request task cancelled by the server (uvicorn cancels what is left after its
    graceful-shutdown timeout) is an expected end, not a crash. Instead of a traceback per connection and a cut
    connection, the client gets what a drained request gets: a 503 if nothing was sent yet, else (a stream) an
    error event and `data: [DONE]`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "sse": False, "done": False}

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            log.debug("request %s %s cancelled by the server", scope.get("method"), scope.get("path"))
            error = APIError(503, SHUTDOWN_MESSAGE, code="shutting_down")
            try:
                if not state["started"]:
                    await asyncio.wait_for(_error(error)(scope, receive, send), 1.0)
                elif state["sse"] and not state["done"]:
                    tail = (_sse(error.body()) + "data: [DONE]\n\n").encode()
                    await asyncio.wait_for(send({"type": "http.response.body", "body": tail, "more_body": False}),
                                           1.0)
            except Exception:  # the connection is gone already: nothing more to say
                pass


def create_app(engine: SpecEngine, config: ServeConfig | None = None) -> FastAPI:
    server = Server(engine, config or ServeConfig())
    cfg = server.config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        try:
            yield
        finally:
            await server.drain()
            server.close()

    app = FastAPI(title="flashdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    openapi = protocol.openapi_document(cfg.model_name, auth=bool(cfg.api_key), max_model_len=server.max_model_len,
                                        vocab_size=server.vocab_size)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect):
        return Response(status_code=499)  # the client left while sending its body: nobody reads this

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {clip(request.url.path)}",
                   405: f"method {request.method} is not allowed on {clip(request.url.path)}"}.get(
            e.status_code, clip(str(e.detail), 200))
        return _error(APIError(e.status_code, message, type="invalid_request_error"), headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error(APIError(400, f"invalid request: {clip(e.errors()[0].get('msg', 'validation failed'), 200)}"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return _error(APIError(500, "internal server error"))

    if cfg.api_key:
        app.add_middleware(BearerAuth, api_key=cfg.api_key)
    app.add_middleware(_ExpectedCancellation)  # added last: the outermost of ours

    @app.get("/health")
    async def health():
        s = server.scheduler
        status = "draining" if server.draining and s.alive else ("ok" if s.alive else "stopped")
        body = {"status": status, "running": s.num_running, "waiting": s.num_waiting, "cycles": s.cycles}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json")
    async def openapi_json():
        return JSONResponse(openapi)

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": server.created, "owned_by": "flashdraft",
                "root": cfg.model_name, "max_model_len": server.max_model_len,
                "speculative": {"method": "dflash" if engine.block_size > 1 else "none",
                                "block_size": engine.block_size}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        server.check_model(name)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.run_in_pool(server.tokenize, await server.read_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await server.run_in_pool(server.detokenize, await server.read_body(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, prompts, choices = await server.prepare(await server.read_body(request), chat=False)
        return await _generate(request, req, prompts, choices, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, prompts, choices = await server.prepare(await server.read_body(request), chat=True)
        return await _generate(request, req, prompts, choices, chat=True)

    async def _generate(request: Request, req, prompts: list[list[int]], choices: list, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        states = [_Choice(c, prompts[i], None if chat or not req.echo else _Echo(
            # completions' echo: the prompt as the client sent it (token ids: decoded), before the completion (none
            # with max_tokens 0)
            req.prompt[i] if isinstance(req.prompt[i], str) and not req.truncate_prompt_tokens
            else server.tokenizer.decode(prompts[i]), prompts[i],
            req.max_tokens != 0), token_text=token_id_text if req.return_tokens_as_token_ids else server.token_text,
            prompt_index=i) for c, (i, _) in enumerate(choices)]
        try:
            for state, (_, params) in zip(states, choices):
                state.handle = server.submit(state.prompt, params,
                                             rid if len(choices) == 1 else f"{rid}-{state.index}", req.priority or 0)
        except BaseException:
            _cancel(states)
            raise
        prompt_tokens = sum(map(len, prompts))
        # (tool_choice, parser) where the output may hold tool calls (`tools.py`)
        tooling = (req.effective_tool_choice, cfg.tool_call_parser) \
            if chat and req.tools and req.effective_tool_choice != "none" else None
        if req.stream:
            return StreamingResponse(_stream(states, rid, prompt_tokens, chat, req.stream_options, tooling),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, states, rid, prompt_tokens, chat, tooling, req.prompt_logprobs)

    def _cancel(states) -> None:
        """Free the batch slots of the choices still running (their client went away, or one of them failed)."""
        for state in states:
            if state.handle is not None and not state.finished:
                server.scheduler.cancel(state.handle.rid)

    async def _collect(request: Request, states, rid: str, prompt_tokens: int, chat: bool, tooling,
                       prompt_top: int | None):
        """Wait for every choice's result, watching for the client going away (then cancel them all).
        `prompt_top`: the prompt's log-probabilities with that many alternatives (vLLM's `prompt_logprobs`)."""

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async def finished(state):
            while True:
                item = await state.handle.queue.get()
                if isinstance(item, Failure) or item.finished:
                    state.finished = True
                    return item

        done_task = asyncio.ensure_future(asyncio.gather(*(finished(state) for state in states)))
        gone_task = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([done_task, gone_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone_task.cancel()
            if not done_task.done():
                done_task.cancel()
                _cancel(states)
        if not done_task.done() or done_task.cancelled():
            return Response(status_code=499)  # nobody is listening
        items = done_task.result()
        failure = next((item for item in items if isinstance(item, Failure)), None)
        if failure is not None:
            raise _failure(failure)
        bodies, n_out = [], 0
        for state, item in zip(states, items):
            state.cached_tokens = item.result.stats.cached_tokens
            text, entries, n, reason = state.result_parts(item.result)
            logprobs = None if entries is None else protocol.logprobs_body(entries, state.token_text, chat)
            calls = None
            if tooling is not None:
                text, calls, reason = tools.read_calls(text, tooling[0], reason, tooling[1])
            bodies.append(protocol.choice_body(state.index, chat, text, reason, logprobs, calls))
            if prompt_top is not None and not chat:  # vLLM's: per choice in completions, once in chat
                bodies[-1]["prompt_logprobs"] = protocol.prompt_logprobs_body(item.result.prompt_logprobs, prompt_top,
                                                                              state.token_text)
            n_out += n
        stats = protocol.merge_stats([server.stats(item.result) for item in items])
        body = protocol.completion_body(rid, cfg.model_name, chat, bodies, server.usage(states, prompt_tokens, n_out),
                                        stats, server.fingerprint)
        if prompt_top is not None and chat:
            body["prompt_logprobs"] = protocol.prompt_logprobs_body(items[0].result.prompt_logprobs, prompt_top,
                                                                    states[0].token_text)
        return body

    async def _stream(states, rid: str, prompt_tokens: int, chat: bool, opts, tooling):
        """The choices' events as SSE chunks in the order they come, each tagged with its choice's index; a usage
        chunk (with every choice's statistics merged) and [DONE] once all have finished. Where the output may hold
        tool calls, content goes out as far as `tools.visible_content` allows, and the calls in one chunk at the
        end."""
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        created, merged = int(time.time()), asyncio.Queue()

        async def pump(state):
            while True:
                item = await state.handle.queue.get()
                await merged.put((state, item))
                if isinstance(item, Failure) or item.finished:
                    return

        def chunk(state, text, finish_reason=None, first=False, choices=True, use=None, logprobs=None):
            body = protocol.chunk_body(rid, cfg.model_name, chat, created, text, finish_reason, first, choices,
                                       server.fingerprint, logprobs, state.index if state is not None else 0)
            if include_usage:
                body["usage"] = use if use is not None else (
                    protocol.usage(prompt_tokens, sum(s.n_out for s in states)) if continuous else None)
            return body

        def logprobs_of(state, entries) -> dict | None:
            """The log-probabilities (if asked) of a choice's tokens whose chunk goes out now (each once, in order)."""
            if not entries:
                return None
            body = protocol.logprobs_body(entries, state.token_text, chat, state.offset)
            state.offset += sum(len(t) for t in body.get("tokens", ()))
            return body

        pumps = [asyncio.ensure_future(pump(state)) for state in states]
        try:
            if chat:
                for state in states:
                    yield _sse(chunk(state, "", first=True))
            results, failed = [], False
            while len(results) < len(states):
                state, item = await merged.get()
                if isinstance(item, Failure):
                    state.finished = failed = True
                    yield _sse(_failure(item).body())
                    break
                if state.echo is not None and not state.echoed:  # the prompt first, in a chunk of its own
                    state.echoed = True
                    yield _sse(chunk(state, state.echo.text, logprobs=logprobs_of(
                        state, _echoed(state.echo.prompt, item.prompt_logprobs))))
                completes = state.echo is None or state.echo.completes
                if completes:
                    state.n_out += len(item.token_ids)
                    state.pending += item.logprobs or ()
                text = item.text
                streamed = tooling is not None and tools.streamed_arguments(tooling[0])
                if completes and text and streamed:  # a named function's arguments, as they come
                    call = {"index": 0, "function": {"arguments": text}}
                    if state.call_id is None:
                        state.call_id = tools.call_id()
                        call.update(id=state.call_id, type="function")
                        call["function"]["name"] = streamed
                    body = chunk(state, None, logprobs=logprobs_of(state, state.pending))
                    body["choices"][0]["delta"] = {"tool_calls": [call]}
                    yield _sse(body)
                    state.sent, state.pending, text = state.sent + len(state.pending), [], ""
                if completes and text and tooling is not None:  # shown as far as no tool call may have begun
                    state.text += text
                    shown = tools.visible_content(state.text, *tooling)
                    text, state.shown = shown[state.shown:], len(shown)
                if completes and text:  # tokens whose text is held back (a partial character, a stop string's
                    # start, a tool call's) wait for the next chunk with text
                    yield _sse(chunk(state, text, logprobs=logprobs_of(state, state.pending)))
                    state.sent, state.pending = state.sent + len(state.pending), []
                if item.finished:
                    state.finished = True
                    result = item.result
                    state.cached_tokens = result.stats.cached_tokens
                    text, _, state.n_out, reason = state.result_parts(result)
                    rest = result.logprobs[state.sent:] if result.logprobs and completes else None
                    if tooling is not None:
                        content, calls, reason = tools.read_calls(text, tooling[0], reason, tooling[1])
                        held = (content or "")[state.shown:]
                        if state.call_id is not None:  # its arguments went out as they came
                            held, calls = "", None
                        if held or calls:
                            body = chunk(state, held, logprobs=logprobs_of(state, rest))
                            rest = None
                            if calls:
                                body["choices"][0]["delta"]["tool_calls"] = [dict(c, index=k)
                                                                             for k, c in enumerate(calls)]
                            yield _sse(body)
                    final = chunk(state, None, reason, logprobs=logprobs_of(state, rest))
                    final["dflash"] = server.stats(result)
                    results.append(final["dflash"])
                    yield _sse(final)
            if include_usage and not failed:
                use = server.usage(states, prompt_tokens, sum(s.n_out for s in states))
                last = chunk(None, None, choices=False, use=use)
                last["dflash"] = protocol.merge_stats(results)
                yield _sse(last)
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            _cancel(states)  # the client went away, the server is stopping, or a choice failed: free the slots

    return app
