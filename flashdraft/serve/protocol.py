"""The OpenAI wire format: request models (pydantic, strict), error bodies, response and chunk builders.

Requests are validated strictly: wrong JSON types are refused (no "1" -> 1 coercion), unknown fields are refused
as the OpenAI API does ("Unrecognized request argument supplied"), and options this server knows but does not
implement (best_of, suffix, ...) are refused with a message naming the option, never silently
ignored. Numbers must be finite (JSON's NaN / Infinity extensions are refused as "must be a finite number", not as
out of range), every string, keys included, must be encodable as UTF-8 (a lone UTF-16 surrogate such as "\\ud800"
is a 400 naming where it is), and whatever a client sent that an error message echoes is clipped (`clip`). Every
failure becomes an `APIError`, rendered as `{"error": {"message", "type", "param", "code"}}` by `error_json`, which
cannot fail. `openapi_document` is the OpenAPI description (request and response schemas) that the app publishes at
/openapi.json.

Structured output comes as OpenAI's `response_format` (`json_object`, `json_schema`) or vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`), on both endpoints; `structured_output()` turns either into the
engine's `StructuredOutput` (whether the grammar compiles for this model's tokenizer is the app's check).
vLLM's /tokenize (a prompt or a conversation) and /detokenize have request models of their own here.

What this module does not know about: the engine (it reads one bound of it, MAX_LOGPROBS, and builds its
`StructuredOutput`), the tokenizer (prompt limits that need token counts are checked in `app.py`), HTTP plumbing.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator

from flashdraft.engine.logprobs import MAX_LOGPROBS  # alternatives per token a request may ask for
from flashdraft.engine.structured import StructuredOutput
from flashdraft.serve.tools import forced_calls

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1  # seeds are refused outside [0, 2**63 - 1] (torch's generators take uint64; JSON clients int64)
MAX_TOP_K = 2**31 - 1  # any top_k >= the vocabulary means no top-k filtering (the app passes 0 then)
MAX_TOKEN_ID = 2**31 - 1  # the schema's bound on token ids; the app checks them against the real vocabulary
MAX_N = 16  # choices per prompt (`n`)
MAX_LOGIT_BIAS = 300  # token ids a request may bias
MAX_ALLOWED_IDS = 1 << 16  # allowed_token_ids a request may list
MAX_BAD_WORDS = 64  # bad_words a request may list
MAX_PRIORITY = 2**31 - 1  # request priorities lie in [-MAX_PRIORITY, MAX_PRIORITY]
MAX_CACHE_SALT_CHARS = 256  # a cache_salt's length
MAX_CHOICES = 64  # choices in one request: prompts of a batched completions request x n
CLIP_CHARS = 64  # how much of a client's string an error message echoes


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    """A client's value as error messages echo it: at most `limit` characters, a lone surrogate escaped."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = f"{text[:limit]}...({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_json(body: dict) -> bytes:
    """The JSON bytes of a response body, whatever strings it carries (a lone surrogate is escaped, never a 500)."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode("ascii")


def check_unicode(data: Any) -> None:
    """400 if any string in the parsed JSON (object keys included) cannot be encoded as UTF-8: JSON may spell a lone
    UTF-16 surrogate ("\\ud800"), which the tokenizer and the response encoder would both choke on."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            strings = [(value, where)]
        elif isinstance(value, dict):
            strings = [(k, where) for k in value]
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            strings = []
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        else:
            continue
        for text, path in strings:
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    param = clip(path) if path else None
                    raise APIError(400, f"{f'{param!r}' if param else 'the request body'} contains a string that is "
                                        f"not valid Unicode (lone UTF-16 surrogate {text[e.start]!r} at character "
                                        f"{e.start}); send UTF-8 text", param=param) from None


class APIError(Exception):
    """An error answered to the client in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else clip(param)
        self.code = code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(name: str, why: str = "") -> APIError:
    return APIError(400, f"'{name}' is not supported by this server{': ' + why if why else ''}", param=name,
                    code="unsupported_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage on every chunk


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is accepted: the output always follows it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'response_format' takes 'json_schema' exactly when its type is 'json_schema'")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a list of choices, a Lark grammar, or any
    JSON object."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: separators ", " and ": ", no other whitespace


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


# JSON schemas of the fields validated by hand (published in /openapi.json; the validators below are the authority)
_STOP_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS},
    {"type": "array", "maxItems": MAX_STOP_STRINGS,
     "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}},
    {"type": "null"}]}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1}, _TOKEN_IDS,
    {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": _TOKEN_IDS}],
    "description": "a prompt (a string or a list of token ids) or a batch of them (a list of strings or of token-id "
                   "lists): one choice per prompt and `n`, choice i * n + j for prompt i"}
_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}


def _finite(**bounds):
    """An optional float field that refuses NaN and +-Infinity (which Python's JSON parser accepts)."""
    return Field(default=None, allow_inf_nan=False, **bounds)


def _only(value, nullable: bool = True, **kw):
    """A field the server refuses unless it equals `value` (or is null): `check_supported` refuses anything else with
    a message naming the option; the published schema says so."""
    allowed = [value] + ([None] if nullable and value is not None else [])
    return Field(json_schema_extra={"enum": allowed}, **kw)


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI ranges; top_k etc. as vLLM extends)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(json_schema_extra={"minLength": 1})
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = _finite(ge=0.0, le=2.0)
    top_p: float | None = _finite(gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = _finite(ge=0.0, le=1.0)  # vLLM's extension (0: off)
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKEN_ID)  # vLLM's: no stop before this many tokens
    # vLLM's: only these ids may be produced
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_IDS)
    # vLLM's: words the output never completes (each banned as written and, where it makes another token sequence of
    # the same length, after a space)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS)
    # vLLM's: each prompt token's log-probability, rank and this many alternatives (not with stream)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: with the server's --scheduling-policy priority, lower values are served first (else only 0)
    priority: int | None = Field(default=None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[Any, WithJsonSchema(_STOP_SCHEMA)] = None
    stop_token_ids: Annotated[list[int] | None, WithJsonSchema({"anyOf": [
        {"type": "array", "maxItems": 64, "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}},
        {"type": "null"}]})] = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = _finite(ge=-2.0, le=2.0)
    frequency_penalty: float | None = _finite(ge=-2.0, le=2.0)
    repetition_penalty: float | None = _finite(ge=0.01, le=10.0)  # vLLM's extension (1: none)
    # {token id as a string: bias in [-100, 100]}, added to the target's logits (OpenAI's bounds: 300 ids)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                     Annotated[float, Field(allow_inf_nan=False, ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    return_tokens_as_token_ids: bool = False  # vLLM's: log-probabilities name tokens "token_id:<id>"
    skip_special_tokens: bool = True  # vLLM's: false keeps special tokens' text in the output
    # vLLM's; accepted, and what it asks is what every tokenizer here does: transformers 5 decodes special tokens'
    # text one way whatever it says (its decode ignores the option), as vLLM's detokenizer does for fast tokenizers
    spaces_between_special_tokens: bool = True
    # vLLM's: keep each prompt's last k tokens (a conversation's, as the template renders it); -1: max_model_len
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_TOKEN_ID)
    # vLLM's: the prefix cache's namespace; prompts share cached pages only with requests of the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

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
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "'truncate_prompt_tokens' must be >= 1, or -1 for the model's context length",
                           param="truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "'prompt_logprobs' are not available when streaming", param="prompt_logprobs")
        self.structured_output()

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the output must follow, from `response_format` or `structured_outputs` (not both)."""
        fmt, extra = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and extra is not None:
            raise APIError(400, "give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
        try:
            if extra is not None:
                return StructuredOutput(json_schema=extra.json_, json_object=bool(extra.json_object),
                                        regex=extra.regex, choice=tuple(extra.choice or ()), grammar=extra.grammar,
                                        any_whitespace=not extra.disable_any_whitespace)
            if fmt is not None and fmt.type == "json_object":
                return StructuredOutput(json_object=True)
            if fmt is not None and fmt.type == "json_schema":
                return StructuredOutput(json_schema=fmt.json_schema.schema_)
        except ValueError as e:
            raise APIError(400, f"'{'structured_outputs' if extra is not None else 'response_format'}': {e}",
                           param="structured_outputs" if extra is not None else "response_format") from None
        return None


class CompletionRequest(_SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    echo: bool = False
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    best_of: int | None = _only(1, default=None)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = _only("", default=None)

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine reports (None: no log-probabilities)."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        """The prompts, as a list: one (a string or a list of token ids) or a batch (a list of either)."""
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"'prompt' has {len(v)} prompts; at most {MAX_CHOICES} in one request")
            return [cls._one_prompt(p) for p in v]
        return [cls._one_prompt(v)]

    @staticmethod
    def _one_prompt(v):
        if isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in v)):
            if not v:
                raise ValueError("'prompt' must not be empty")
            return v
        raise ValueError("'prompt' must be a string, a list of integer token ids, or a list of either")

    def check_supported(self) -> None:
        super().check_supported()
        if len(self.prompt) * (self.n or 1) > MAX_CHOICES:
            raise APIError(400, f"{len(self.prompt)} prompts x n = {self.n} is more than {MAX_CHOICES} choices in one "
                                "request", param="n")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "'max_tokens' must be >= 1; 0 is only allowed with 'echo': true (to score the prompt)",
                           param="max_tokens")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")
        if self.suffix:
            raise unsupported("suffix")


_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries (e.g. Qwen3's enable_thinking)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: any object)
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=_TOOL_NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as the server returned it


class ToolCall(BaseModel):
    """A call an assistant message made earlier in the conversation."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, WithJsonSchema({"anyOf": [_CONTENT_SCHEMA, {"type": "null"}]})] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made (content may then be null)
    tool_call_id: str | None = None  # tool messages: the call this answers

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("message 'content' is required (null only for an assistant message with 'tool_calls')")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("'tool_call_id' is required on tool messages and only there")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        """A string, or a list of `{"type": "text", "text": ...}` parts (joined); nothing else (no images)."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            out = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError("message content parts must be {'type': 'text', 'text': str}; got "
                                     f"{clip(repr(kind))} (images, audio and files are not supported)")
                if set(part) - {"type", "text"}:
                    raise ValueError(f"unknown keys in a content part: {clip(sorted(set(part) - {'type', 'text'}))}")
                out.append(part["text"])
            return "".join(out)
        raise ValueError("message 'content' must be a string or a list of text parts")

    @property
    def text_bytes(self) -> int:
        return len((self.content or "").encode("utf-8"))


class _ChatTemplateFields(BaseModel):
    """The fields /v1/chat/completions and /tokenize render through the chat template (`Server.render_chat`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=MAX_TEMPLATE_KWARGS)  # vLLM's

    @model_validator(mode="before")
    @classmethod
    def _messages_present(cls, data):
        if isinstance(data, dict) and data.get("messages") == []:
            raise ValueError("'messages' must contain at least one message")
        return data

    def check_template_fields(self) -> None:
        """vLLM's rules for continuing the last message: it is the assistant's, and no generation prompt follows."""
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(400, "'continue_final_message' continues the last message: send "
                                    "'add_generation_prompt': false with it", param="continue_final_message")
            if self.messages[-1].role != "assistant":
                raise APIError(400, "'continue_final_message' needs the last message to be the assistant's, got "
                                    f"{self.messages[-1].role!r}", param="continue_final_message")

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]


class ChatCompletionRequest(_ChatTemplateFields, _SamplingFields):
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = Field(default=None, json_schema_extra={"maxItems": 0})
    function_call: Annotated[Any, WithJsonSchema({"enum": ["none", None]})] = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        self.check_template_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        if self.functions:
            raise unsupported("functions", "use 'tools'")
        if self.function_call not in (None, "none"):
            raise unsupported("function_call", "use 'tool_choice'")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise APIError(400, "'tools' names a function twice", param="tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(400, f"'tool_choice' names {clip(self.tool_choice.function.name)!r}, which is not in "
                                "'tools'", param="tool_choice")
        if self.calls_forced and super().structured_output() is not None:
            raise APIError(400, "a forced tool call ('tool_choice' required or a function) and a structured output "
                                "cannot be combined", param="tool_choice")
        super().check_supported()  # last: it builds the structured output, a forced call's from the tools checked

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self):
        """OpenAI's default: "auto" with tools, "none" without; a named choice as a dict."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    @property
    def calls_forced(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def structured_output(self) -> StructuredOutput | None:
        """A forced tool call's constraint (`tools.forced_calls`), else the request's structured output."""
        if self.calls_forced:
            return forced_calls(self.tool_dicts(), self.effective_tool_choice, self.parallel_tool_calls is not False)
        return super().structured_output()

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine reports (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class _TokenizerFields(BaseModel):
    """Fields of vLLM's /tokenize and /detokenize (`model` optional, as there; checked when given)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None

    def check_supported(self) -> None:
        pass


class TokenizeCompletionRequest(_TokenizerFields):
    """/tokenize of a plain prompt: the ids /v1/completions would run (`add_special_tokens` as the tokenizer's call)."""

    prompt: str = Field(min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateFields, _TokenizerFields):
    """/tokenize of a conversation: the ids /v1/chat/completions would run for these messages and tools."""

    return_token_strs: bool = False

    def check_supported(self) -> None:
        self.check_template_fields()


def tokenize_request_model(data: dict) -> type[BaseModel]:
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


class DetokenizeRequest(_TokenizerFields):
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = Field(max_length=1 << 20)


# ---- parsing: bytes -> validated model, every failure an APIError(400) ----------------------------------------


def parse_body(raw: bytes, model_cls: type[BaseModel] | Callable[[dict], type[BaseModel]]):
    """`model_cls`: the request's model, or a function of the parsed object choosing it."""
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
    check_unicode(data)
    if not isinstance(model_cls, type):
        model_cls = model_cls(data)
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
    param = clip(".".join(loc)) if loc else None
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if kind == "missing":
        return APIError(400, f"missing required parameter '{param}'", param=param)
    if kind == "value_error":
        return APIError(400, msg.removeprefix("Value error, "), param=param)
    if kind in _TYPE_NAMES:
        return APIError(400, f"'{param}' must be {_TYPE_NAMES[kind]}, got {_shown(err.get('input'))}", param=param)
    if kind == "finite_number":
        return APIError(400, f"'{param}' must be a finite number, got {_shown(err.get('input'))}", param=param)
    return APIError(400, f"invalid value for '{param}': {msg}, got {_shown(err.get('input'))}", param=param)


def _shown(value: Any) -> str:
    """A client's JSON value, short (no 10 MB echo)."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"{'a list' if isinstance(value, list) else 'an object'} of {len(value)} items"
    if isinstance(value, str) and len(value) > 4 * CLIP_CHARS:
        value = value[:4 * CLIP_CHARS]
    return clip(json.dumps(value))


# ---- responses -----------------------------------------------------------------------------------------------


def dflash_stats(stats, block_size: int) -> dict:
    """The acceptance statistics carried by every response (vLLM's counting: drafts, draft/accepted tokens), and
    what the draft policy chose: the width verified by each drafting cycle (1 where the confidence trim kept none
    of its drafts), the one-token steps; the drafting
    cycles whose chain prompt lookup continued (`lookup_splice`), and the one-token steps that verified a lookup
    continuation with its tokens verified and accepted (`lookup_steps`; not in the drafter's figures)."""
    k = max(0, block_size - 1)
    drafts = stats.num_drafts if k else 0
    return {
        "tau": round(stats.tau, 4) if k else 1.0,
        "drafts": drafts,
        "draft_tokens": stats.drafted_tokens if k else 0,
        "verify_widths": list(stats.verify_widths) if k else [],
        "one_token_steps": stats.plain_steps if k else 0,
        "lookup_splices": stats.lookup_splices if k else 0,
        "lookup_steps": stats.lookup_steps if k else 0,
        "lookup_draft_tokens": stats.lookup_drafts if k else 0,
        "lookup_accepted_tokens": stats.lookup_accepted if k else 0,
        "accepted_tokens": stats.num_accepted_tokens if k else 0,
        "acceptance_histogram": stats.histogram if k else [],
        "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance] if k else [],
        "block_size": block_size,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with a prefix cache, `prompt_tokens_details.cached_tokens`: the prompt tokens it gave."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def logprobs_body(entries, token_text, chat: bool, offset: int = 0) -> dict:
    """Tokens' log-probabilities (`engine.logprobs.TokenLogprob`) in OpenAI's shape: chat's
    `{"content": [{token, logprob, bytes, top_logprobs}]}`, or the completions API's `{tokens, token_logprobs,
    top_logprobs, text_offset}`, where each top_logprobs dict also holds the chosen token (up to the request's
    `logprobs` + 1 entries, as OpenAI documents), text offsets count from `offset` by the tokens' strings, and an
    echoed prompt's first token, which nothing predicts (logprob None), has null figures. `token_text`: id -> the
    token's string."""
    if chat:
        def item(token, logprob):
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}
    tokens = [token_text(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [None if e.logprob is None else {**{token_text(t): lp for t, lp in e.top}, text: e.logprob}
           for e, text in zip(entries, tokens)]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
            "text_offset": offsets}


def merge_stats(items: list[dict]) -> dict:
    """The acceptance statistics of several choices (`dflash_stats` of each) as one: counts summed, tau and
    per-position acceptance over all their drafting cycles."""
    if len(items) == 1:
        return items[0]
    out = {k: sum(d[k] for d in items) for k in ("drafts", "draft_tokens", "one_token_steps", "lookup_splices",
                                                  "lookup_steps", "lookup_draft_tokens", "accepted_tokens")}
    drafts = out["drafts"]
    out["tau"] = round(1 + out["accepted_tokens"] / drafts, 4) if drafts else 1.0
    out["verify_widths"] = [w for d in items for w in d["verify_widths"]]
    out["acceptance_histogram"] = [sum(column) for column in zip(*(d["acceptance_histogram"] for d in items))]
    positions = range(len(items[0]["per_position_acceptance"]))
    out["per_position_acceptance"] = [
        round(sum(d["drafts"] * d["per_position_acceptance"][i] for d in items) / drafts, 4) if drafts else 0.0
        for i in positions]
    out["block_size"] = items[0]["block_size"]
    return out


def choice_body(index: int, chat: bool, text: str | None, finish_reason: str, logprobs: dict | None = None,
                tool_calls: list | None = None) -> dict:
    if chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def prompt_logprobs_body(entries: list, top: int, token_text) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (null first: nothing precedes it) {token id: {"logprob", "rank",
    "decoded_token"}} for the token itself and the `top` likeliest tokens there (ranked 1 .. top)."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        figures = {str(t): {"logprob": v, "rank": k + 1, "decoded_token": token_text(t)}
                   for k, (t, v) in enumerate(e.top[:top])}
        figures.setdefault(str(e.token), {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(e.token)})
        out.append(figures)
    return out


def completion_body(rid: str, model: str, chat: bool, choices: list[dict], use: dict, stats: dict,
                    fingerprint: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": choices, "usage": use, "dflash": stats}


def chunk_body(rid: str, model: str, chat: bool, created: int, text: str | None, finish_reason: str | None = None,
               first: bool = False, choices: bool = True, fingerprint: str | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "system_fingerprint": fingerprint, "choices": []}
    if choices:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        else:
            body["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs,
                                "finish_reason": finish_reason}]
    return body


# ---- the published schema (GET /openapi.json) -------------------------------------------------------------------

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {**{k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                         "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"], "properties": {
                             "cached_tokens": {"type": "integer", "minimum": 0}}}}}
_STATS = {"type": "object",
          "required": ["tau", "drafts", "draft_tokens", "accepted_tokens", "acceptance_histogram",
                       "per_position_acceptance", "block_size"],
          "properties": {"tau": {"type": "number", "minimum": 0}, "drafts": {"type": "integer", "minimum": 0},
                         "draft_tokens": {"type": "integer", "minimum": 0},
                         "verify_widths": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                         "one_token_steps": {"type": "integer", "minimum": 0},
                         "lookup_splices": {"type": "integer", "minimum": 0},
                         "lookup_steps": {"type": "integer", "minimum": 0},
                         "lookup_draft_tokens": {"type": "integer", "minimum": 0},
                         "lookup_accepted_tokens": {"type": "integer", "minimum": 0},
                         "accepted_tokens": {"type": "integer", "minimum": 0},
                         "acceptance_histogram": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                         "per_position_acceptance": {"type": "array", "items": {"type": "number"}},
                         "block_size": {"type": "integer", "minimum": 1}}}
_FINISH = {"enum": ["stop", "length"]}
# what a seeded request's text depends on besides the model and the request (OpenAI's field for the purpose)
_FINGERPRINT = {"type": ["string", "null"]}
_TOKEN_LOGPROB = {"type": "object", "required": ["token", "logprob", "bytes"],
                  "properties": {"token": {"type": "string"}, "logprob": {"type": "number", "maximum": 0},
                                 "bytes": {"type": "array",
                                           "items": {"type": "integer", "minimum": 0, "maximum": 255}}}}
# null unless the request asked: chat's {"content": [...]}, or the completions API's parallel lists
_LOGPROBS = {"anyOf": [
    {"type": "null"},
    {"type": "object", "required": ["content"], "properties": {"content": {"type": "array", "items": {
        **_TOKEN_LOGPROB, "required": ["token", "logprob", "bytes", "top_logprobs"],
        "properties": {**_TOKEN_LOGPROB["properties"], "top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}}}}}},
    {"type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"], "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"], "maximum": 0}},
        "top_logprobs": {"type": "array", "items": {"anyOf": [
            {"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]}},
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}]}
# vLLM's per prompt token: null first, then {token id: figures} for the token and the alternatives asked for
_PROMPT_LOGPROBS = {"anyOf": [{"type": "null"}, {"type": "array", "items": {"anyOf": [
    {"type": "null"}, {"type": "object", "additionalProperties": {
        "type": "object", "required": ["logprob", "rank", "decoded_token"],
        "properties": {"logprob": {"type": "number", "maximum": 0}, "rank": {"type": "integer", "minimum": 1},
                       "decoded_token": {"type": "string"}}}}]}}]}
_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage", "dflash"],
               "properties": {
                   "id": {"type": "string"}, "object": {"enum": ["text_completion", "chat.completion"]},
                   "created": {"type": "integer"}, "model": {"type": "string"}, "system_fingerprint": _FINGERPRINT,
                   "choices": {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {
                       "type": "object", "required": ["index", "finish_reason"],
                       "properties": {"index": {"type": "integer", "minimum": 0, "maximum": MAX_CHOICES - 1},
                                      "text": {"type": "string"}, "finish_reason": _FINISH,
                                      "logprobs": _LOGPROBS, "prompt_logprobs": _PROMPT_LOGPROBS,
                                      "message": {"type": "object", "required": ["role", "content"], "properties": {
                                          "role": {"const": "assistant"}, "content": {"type": "string"}}}}}},
                   "usage": _USAGE, "dflash": _STATS, "prompt_logprobs": _PROMPT_LOGPROBS}}
_CHUNK = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
          "properties": {
              "id": {"type": "string"}, "object": {"enum": ["text_completion", "chat.completion.chunk"]},
              "created": {"type": "integer"}, "model": {"type": "string"}, "system_fingerprint": _FINGERPRINT,
              "choices": {"type": "array", "maxItems": 1, "items": {
                  "type": "object", "required": ["index", "finish_reason"],
                  "properties": {"index": {"type": "integer", "minimum": 0, "maximum": MAX_CHOICES - 1},
                                 "text": {"type": "string"}, "logprobs": _LOGPROBS,
                                 "delta": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                                            "content": {"type": "string"}}},
                                 "finish_reason": {"enum": ["stop", "length", None]}}}},
              "usage": {"anyOf": [_USAGE, {"type": "null"}]}, "dflash": _STATS}}
# one server-sent event: `data: <a chunk or an error as JSON>`, and the last one `data: [DONE]`
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    {"const": "[DONE]"},
    {"type": "string", "not": {"const": "[DONE]"}, "contentMediaType": "application/json",
     "contentSchema": {"anyOf": [_CHUNK, _ERROR]}}]}}}
_MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
               "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                              "owned_by": {"type": "string"}, "max_model_len": {"type": "integer", "minimum": 1}}}
_MODEL_LIST = {"type": "object", "required": ["object", "data"],
               "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL_CARD}}}
_HEALTH = {"type": "object", "required": ["status", "running", "waiting", "cycles"],
           "properties": {"status": {"enum": ["ok", "draining", "stopped"]},
                          "running": {"type": "integer", "minimum": 0}, "waiting": {"type": "integer", "minimum": 0},
                          "cycles": {"type": "integer", "minimum": 0}}}

_TOKENIZED = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
              "properties": {"count": {"type": "integer", "minimum": 0},
                             "max_model_len": {"type": "integer", "minimum": 1},
                             "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                             "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}},
                                                      {"type": "null"}]}}}
_DETOKENIZED = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what an API key protects (/health, /metrics stay open)


def openapi_document(model_name: str, auth: bool = False, max_model_len: int | None = None,
                     vocab_size: int | None = None, version: str = "0.1.0") -> dict:
    """The OpenAPI 3.1 description of every route, with the request schemas the validators enforce and the response
    shapes (errors included) the server answers with; a server error (5xx other than 503) is never documented.
    With the served model's context length and vocabulary size, token counts and token ids get their real bounds
    (a prompt's length in tokens still cannot be stated: a schema-valid request may be refused for its context)."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest,
                                                              TokenizeCompletionRequest, TokenizeChatRequest,
                                                              DetokenizeRequest)],
                                 ref_template="#/components/schemas/{model}")
    schemas = copy.deepcopy(defs.get("$defs", {}))  # (WithJsonSchema dicts are shared with the models)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [model_name]}  # the only model this server has
        if max_model_len:
            for key in ("max_tokens", "max_completion_tokens"):
                if key in props:
                    low = 0 if name == "CompletionRequest" and key == "max_tokens" else 1
                    props[key] = {"anyOf": [{"type": "integer", "minimum": low, "maximum": max_model_len},
                                            {"type": "null"}], "default": None}
        if vocab_size:
            token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
            props["stop_token_ids"]["anyOf"][0]["items"] = token
            if "prompt" in props:
                ids = {"type": "array", "minItems": 1, "items": token}
                if max_model_len:
                    ids["maxItems"] = max_model_len
                string = {"type": "string", "minLength": 1}
                batches = [{"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": s} for s in (string, ids)]
                props["prompt"] = {"anyOf": [string, ids, *batches], "description": _PROMPT_SCHEMA["description"]}
    for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                                                "default": None}
    if vocab_size:
        schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = {"type": "integer", "minimum": 0,
                                                                         "maximum": vocab_size - 1}
    schemas.update(Error=_ERROR, Completion=_COMPLETION, ModelCard=_MODEL_CARD, ModelList=_MODEL_LIST,
                   Health=_HEALTH, Tokenized=_TOKENIZED, Detokenized=_DETOKENIZED)

    def ref(name):
        return {"$ref": f"#/components/schemas/{name}"}

    def error(description):
        return {"description": description, "content": {"application/json": {"schema": ref("Error")}}}

    v1_errors = {"401": error("missing or wrong API key")} if auth else {}
    generate_errors = {
        "400": error("invalid request (validation, context length, unsupported option)"),
        "404": error("unknown model"), "408": error("the body did not arrive within --body-timeout"),
        "413": error("the body is larger than --max-body-bytes"), "429": error("the waiting queue is full"),
        "503": error("the server is shutting down"), **v1_errors}

    def generate(summary, body):
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(body)}}},
            "responses": {"200": {"description": "the completion (JSON), or server-sent events when stream is true",
                                  "content": {"application/json": {"schema": ref("Completion")},
                                              "text/event-stream": {"schema": _SSE_EVENT}}},
                          **generate_errors}}}

    def tokenizer_route(summary, body, answer):
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": answer[1], "content": {"application/json": {"schema": ref(answer[0])}}},
                          **{k: v for k, v in generate_errors.items() if k != "429"}}}}

    doc = {
        "openapi": "3.1.0",
        "info": {"title": "flashdraft", "version": version,
                 "description": "OpenAI-compatible completions with DFlash speculative decoding"},
        "paths": {
            "/v1/completions": generate("Create a completion", "CompletionRequest"),
            "/v1/chat/completions": generate("Create a chat completion", "ChatCompletionRequest"),
            "/v1/models": {"get": {"summary": "List the served model", "responses": {
                "200": {"description": "the model list",
                        "content": {"application/json": {"schema": ref("ModelList")}}}, **v1_errors}}},
            "/v1/models/{name}": {"get": {
                "summary": "Describe a model",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model card",
                                      "content": {"application/json": {"schema": ref("ModelCard")}}},
                              "404": error("unknown model"), **v1_errors}}},
            "/tokenize": tokenizer_route(
                "The token ids a prompt or a conversation runs as (vLLM's /tokenize)",
                {"anyOf": [ref("TokenizeCompletionRequest"), ref("TokenizeChatRequest")]},
                ("Tokenized", "the ids, their count and the context length")),
            "/detokenize": tokenizer_route("The text of token ids (vLLM's /detokenize)", ref("DetokenizeRequest"),
                                           ("Detokenized", "the text")),
            "/health": {"get": {"summary": "Liveness and load", "responses": {
                "200": {"description": "serving", "content": {"application/json": {"schema": ref("Health")}}},
                "503": {"description": "draining or stopped",
                        "content": {"application/json": {"schema": ref("Health")}}}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "exposition text", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {
                "description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
        "components": {"schemas": schemas},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith(GUARDED_PATHS):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
