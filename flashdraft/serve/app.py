"""The HTTP layer: an OpenAI-compatible FastAPI app in front of the scheduler.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with
`stream_options.include_usage`), GET /health, GET /metrics (Prometheus). Request flow: read the raw body ->
`protocol.parse_body` (UTF-8, JSON, strict pydantic, unsupported options) -> model name, optional Bearer key ->
tokenize (chat: the target's chat template) -> context-length checks -> `Scheduler.submit` (429 when the queue
is full) -> events from the request's asyncio queue become one JSON body or SSE chunks. Every response carries
its acceptance statistics in a `flashdraft` field (on the final chunk when streaming). A client that disconnects,
streaming or not, has its request cancelled at once, which frees its batch slot. Every error, FastAPI's own
included (404 route, 405 method), is answered in the OpenAI shape; validation errors are 400, not 422.
Shutdown (lifespan end): new requests get 503, in-flight ones get `drain_timeout` seconds to finish, then the
rest are cancelled with an error.

What this module does not know about: how batching, drafting or verification work (the scheduler and the engine),
model loading and command-line options (`cli.py`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashdraft.engine import SamplingParams, SpecEngine
from flashdraft.serve import protocol
from flashdraft.serve.metrics import Metrics
from flashdraft.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from flashdraft.serve.scheduler import Failure, QueueFull, Scheduler, SchedulerClosed

log = logging.getLogger("flashdraft.serve")


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


class Server:
    """What the routes share: engine facts, the scheduler, metrics."""

    def __init__(self, engine: SpecEngine, config: ServeConfig):
        if engine.tokenizer is None:
            raise ValueError("serving needs a tokenizer: the target has none")
        self.engine, self.config, self.tokenizer = engine, config, engine.tokenizer
        limit = engine.max_positions
        self.max_model_len = min(x for x in (config.max_model_len, limit) if x) if (config.max_model_len or limit) \
            else 1 << 30
        self.vocab_size = engine.target.vocab_size
        self.metrics = Metrics(config.model_name)
        self.scheduler = Scheduler(engine, config.max_batch_size, config.max_queue, config.max_prefill_tokens,
                                   self.metrics, threads=config.threads)
        self.eos_ids = _eos_ids(engine)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.created = int(time.time())

    # ---- request -> (prompt ids, SamplingParams) ----------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.config.model_name}'",
                           param="model", code="model_not_found")

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            ids = list(self.tokenizer(req.prompt)["input_ids"])
            if not ids:
                raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
            return ids
        bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"'prompt' has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                           param="prompt")
        return list(req.prompt)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not self.has_chat_template:
            raise APIError(400, f"the model '{self.config.model_name}' has no chat template, so /v1/chat/completions "
                                "cannot format messages; use /v1/completions with a plain prompt", param="messages",
                           code="no_chat_template")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                     tokenize=True, return_dict=False)
        except Exception as e:  # jinja raises for conversations the template refuses (e.g. role order)
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        if not ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        return list(ids)

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
        top_k = req.top_k or 0
        try:
            return SamplingParams(
                max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p), top_k=0 if top_k < 0 else top_k,
                stop_token_ids=tuple(dict.fromkeys(stop_ids)), stop_strings=tuple(req.stop or ()), seed=req.seed,
                include_stop_str_in_output=req.include_stop_str_in_output)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def submit(self, prompt: list[int], params: SamplingParams, rid: str):
        try:
            return self.scheduler.submit(prompt, params, rid)
        except QueueFull as e:
            self.metrics.rejected("queue_full")
            raise APIError(429, str(e), code="queue_full") from None
        except SchedulerClosed as e:
            self.metrics.rejected("shutting_down")
            raise APIError(503, str(e), code="shutting_down") from None

    def stats(self, result) -> dict:
        return protocol.dflash_stats(result.stats, self.engine.block_size)


def _eos_ids(engine: SpecEngine) -> list[int]:
    ids = []
    tok_eos = getattr(engine.tokenizer, "eos_token_id", None)
    gen = getattr(getattr(engine.target, "model", None), "generation_config", None)
    for x in (tok_eos, getattr(gen, "eos_token_id", None)):
        for t in (x if isinstance(x, (list, tuple)) else [x]):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return ids


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class BearerAuth:
    """Pure ASGI middleware (streams and disconnects pass through untouched): /v1/* needs `Bearer <api_key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                what = "missing" if not header else "invalid"
                await _error(APIError(401, f"{what} API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: SpecEngine, config: ServeConfig | None = None) -> FastAPI:
    server = Server(engine, config or ServeConfig())
    cfg = server.config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        yield
        await asyncio.to_thread(server.scheduler.stop, cfg.drain_timeout)

    app = FastAPI(title="flashdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(APIError(e.status_code, message, type="invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error(APIError(400, f"invalid request: {e.errors()[0].get('msg', 'validation failed')}"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return _error(APIError(500, "internal server error"))

    if cfg.api_key:
        app.add_middleware(BearerAuth, api_key=cfg.api_key)

    @app.get("/health")
    async def health():
        s = server.scheduler
        body = {"status": "ok" if s.alive else "stopped", "running": s.num_running, "waiting": s.num_waiting,
                "cycles": s.cycles}
        return JSONResponse(body, status_code=200 if s.alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = protocol.parse_body(await request.body(), CompletionRequest)
        server.check_model(req.model)
        prompt = server.completion_prompt(req)
        params = server.sampling_params(req, len(prompt), req.max_tokens, cfg.default_completion_tokens)
        return await _generate(request, req, prompt, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = protocol.parse_body(await request.body(), ChatCompletionRequest)
        server.check_model(req.model)
        prompt = server.chat_prompt(req)
        params = server.sampling_params(req, len(prompt), req.max_new_tokens, None)
        return await _generate(request, req, prompt, params, chat=True)

    async def _generate(request: Request, req, prompt: list[int], params: SamplingParams, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        handle = server.submit(prompt, params, rid)
        if req.stream:
            opts = req.stream_options
            return StreamingResponse(_stream(handle, rid, len(prompt), chat, opts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, handle, rid, len(prompt), chat)

    async def _collect(request: Request, handle, rid: str, prompt_len: int, chat: bool):
        """Wait for the result, watching for the client going away (then cancel the request)."""

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async def finished():
            while True:
                item = await handle.queue.get()
                if isinstance(item, Failure) or item.finished:
                    return item

        done_task, gone_task = asyncio.ensure_future(finished()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([done_task, gone_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone_task.cancel()
            if not done_task.done():
                done_task.cancel()
                server.scheduler.cancel(rid)
        if not done_task.done() or done_task.cancelled():
            return Response(status_code=499)  # nobody is listening
        item = done_task.result()
        if isinstance(item, Failure):
            raise APIError(item.status, item.message)
        result = item.result
        return protocol.completion_body(rid, cfg.model_name, chat, result.text or "", result.finish_reason,
                                        protocol.usage(prompt_len, len(result.token_ids)), server.stats(result))

    async def _stream(handle, rid: str, prompt_len: int, chat: bool, opts):
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        created, finished, n_out = int(time.time()), False, 0

        def chunk(text, finish_reason=None, first=False, choices=True, use=None):
            body = protocol.chunk_body(rid, cfg.model_name, chat, created, text, finish_reason, first, choices)
            if include_usage:
                body["usage"] = use if use is not None else (
                    protocol.usage(prompt_len, n_out) if continuous else None)
            return body

        try:
            if chat:
                yield _sse(chunk("", first=True))
            while True:
                item = await handle.queue.get()
                if isinstance(item, Failure):
                    finished = True
                    yield _sse(APIError(item.status, item.message).body())
                    break
                n_out += len(item.token_ids)
                if item.text:
                    yield _sse(chunk(item.text))
                if item.finished:
                    finished = True
                    result = item.result
                    n_out = len(result.token_ids)
                    final = chunk(None, result.finish_reason)
                    final["dflash"] = server.stats(result)
                    yield _sse(final)
                    if include_usage:
                        last = chunk(None, choices=False, use=protocol.usage(prompt_len, n_out))
                        last["dflash"] = final["dflash"]
                        yield _sse(last)
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the server is stopping): free the slot now
                server.scheduler.cancel(rid)

    return app
