"""The OpenAI wire format: request models (pydantic, strict), error bodies, response and chunk builders.

Requests are validated strictly: wrong JSON types are refused (no "1" -> 1 coercion), unknown fields are refused
as the OpenAI API does ("Unrecognized request argument supplied"), and options this server knows but does not
implement (n > 1, logprobs, tools, penalties, ...) are refused with a message naming the option, never silently
ignored. Every failure becomes an `APIError`, rendered as `{"error": {"message", "type", "param", "code"}}`.

What this module does not know about: the engine, the tokenizer (prompt limits that need token counts are
checked in `app.py`), HTTP plumbing.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error answered to the client in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(name: str, why: str = "") -> APIError:
    return APIError(400, f"'{name}' is not supported by this server{': ' + why if why else ''}", param=name,
                    code="unsupported_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage on every chunk


def _check_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("'stop' must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"'stop' has {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in value:
        if s == "":
            raise ValueError("'stop' strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"'stop' strings must be at most {MAX_STOP_STRING_CHARS} characters")
    return value


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI ranges; top_k etc. as vLLM extends)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        return _check_stop(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and (len(v) > 64 or any(t < 0 for t in v)):
            raise ValueError("'stop_token_ids' must be at most 64 non-negative token ids")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v):
        if not v:
            raise ValueError("'model' must be a non-empty string")
        return v

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise unsupported("n", "only n=1 is supported; send several requests instead")
        if self.presence_penalty:
            raise unsupported("presence_penalty", "penalties would change the target's distribution")
        if self.frequency_penalty:
            raise unsupported("frequency_penalty", "penalties would change the target's distribution")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")


class CompletionRequest(_SamplingFields):
    prompt: Any
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        """One prompt: a string, a list of token ids, or a one-element list of either."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            if v == "":
                raise ValueError("'prompt' must not be empty")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("'prompt' must not be empty")
            if all(isinstance(t, str) for t in v) or all(isinstance(t, list) for t in v):
                raise ValueError("batched prompts (a list of several prompts) are not supported; send one request "
                                 "per prompt")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise ValueError("'prompt' must be a string or a list of integer token ids")
            return v
        raise ValueError("'prompt' must be a string or a list of integer token ids")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")
        if self.logprobs is not None:
            raise unsupported("logprobs")
        if self.echo:
            raise unsupported("echo")
        if self.suffix:
            raise unsupported("suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        """A string, or a list of `{"type": "text", "text": ...}` parts (joined); nothing else (no images)."""
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            out = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"message content parts must be {{'type': 'text', 'text': str}}; got {kind!r} "
                                     "(images, audio and files are not supported)")
                if set(part) - {"type", "text"}:
                    raise ValueError(f"unknown keys in a content part: {sorted(set(part) - {'type', 'text'})}")
                out.append(part["text"])
            return "".join(out)
        raise ValueError("message 'content' must be a string or a list of text parts")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="before")
    @classmethod
    def _messages_present(cls, data):
        if isinstance(data, dict) and data.get("messages") == []:
            raise ValueError("'messages' must contain at least one message")
        return data

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise unsupported("logprobs")
        if self.top_logprobs is not None:
            raise unsupported("top_logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise unsupported(name, "tool calling is not implemented")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise unsupported(name, "tool calling is not implemented")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise unsupported("response_format", "only {'type': 'text'} is supported (no constrained decoding)")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- parsing: bytes -> validated model, every failure an APIError(400) ----------------------------------------


def parse_body(raw: bytes, model_cls: type[BaseModel]):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise APIError(400, "request body is empty; send a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        request = model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    request.check_supported()
    return request


_TYPE_NAMES = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
               "list_type": "a list", "dict_type": "an object", "model_type": "an object"}


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a clear OpenAI-style message naming the parameter."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    param = ".".join(loc) if loc else None
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if kind == "missing":
        return APIError(400, f"missing required parameter '{param}'", param=param)
    if kind == "value_error":
        return APIError(400, msg.removeprefix("Value error, "), param=param)
    if kind in _TYPE_NAMES:
        return APIError(400, f"'{param}' must be {_TYPE_NAMES[kind]}, got {json.dumps(err.get('input'))[:80]}",
                        param=param)
    return APIError(400, f"invalid value for '{param}': {msg}", param=param)


# ---- responses -----------------------------------------------------------------------------------------------


def dflash_stats(stats, block_size: int) -> dict:
    """The acceptance statistics carried by every response (vLLM's counting: drafts, draft/accepted tokens)."""
    k = max(0, block_size - 1)
    drafts = stats.num_drafts if k else 0
    return {
        "tau": round(stats.tau, 4) if k else 1.0,
        "drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted_tokens": stats.num_accepted_tokens if k else 0,
        "acceptance_histogram": stats.histogram if k else [],
        "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance] if k else [],
        "block_size": block_size,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, chat: bool, text: str, finish_reason: str, use: dict, stats: dict) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use, "dflash": stats}


def chunk_body(rid: str, model: str, chat: bool, created: int, text: str | None, finish_reason: str | None = None,
               first: bool = False, choices: bool = True) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": []}
    if choices:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        else:
            body["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    return body
