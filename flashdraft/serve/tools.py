"""Tool calling on /v1/chat/completions: how `tools` and `tool_choice` become a constraint and how the output becomes
`tool_calls`.

- `tool_choice: "required"` or a named function: the output is forced to be calls, through structured output (the
  engine's grammar masks): a named function's output is its arguments (an object following its `parameters`
  schema); "required" is a JSON array of `{"name", "parameters"}` objects, one of the tools each (one item when
  `parallel_tool_calls` is false), as vLLM defines it, in compact JSON (separators ", " and ": ": arguments are
  for programs, and free whitespace is where small models loop). The text is then exactly the calls: parsing
  cannot fail on a finished output (a `length` cut leaves the text as content instead). A stream sends a named
  function's arguments as they are generated (OpenAI's `tool_calls` deltas), `"required"`'s calls whole at the end.
- `tool_choice: "auto"` (OpenAI's default with tools): the model decides, so its calls must be read out of free text
  in the format its chat template taught it. Only with `flashdraft serve --tool-call-parser hermes`: the
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of Hermes-style templates (Qwen2.5, Qwen3);
  the text outside them stays the content. Streams hold back text from where a block may begin.
- `tool_choice: "none"`: the tools reach the chat template, nothing is parsed.

What this module does not know about: HTTP, the request models (protocol.py validates them), the engine.
"""

from __future__ import annotations

import json
import re
import uuid

from flashdraft.engine.structured import StructuredOutput

PARSERS = ("hermes",)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


def parameters_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def forced_calls(tools: list[dict], tool_choice, parallel: bool) -> StructuredOutput | None:
    """The constraint that makes the output calls (`tool_choice` "required" or a named function), else None."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise ValueError(f"tool_choice names {name!r}, which is not in 'tools'")
        return StructuredOutput(json_schema=parameters_schema(tool), any_whitespace=False)
    if tool_choice != "required":
        return None
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                       "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters_schema(t)}}
                      for t in tools]}
    return StructuredOutput(json_schema={"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                                         "items": call}, any_whitespace=False)


def _call(name: str, arguments) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def streamed_arguments(tool_choice) -> str | None:
    """The function whose arguments a stream sends as they are generated: a named `tool_choice`'s (its output is
    the arguments, nothing else), else None (calls go out whole at the end)."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def read_calls(text: str, tool_choice, finish_reason: str, parser: str | None) -> tuple[str | None, list | None, str]:
    """(content, tool calls or None, finish reason) of a finished output."""
    if isinstance(tool_choice, dict) or tool_choice == "required":
        try:  # a `length` cut or a stop string leaves a partial call: the text stays content
            value = json.loads(text) if finish_reason == "stop" else None
        except json.JSONDecodeError:
            value = None
        if value is None:
            return text, None, finish_reason
        if isinstance(tool_choice, dict):
            return None, [_call(tool_choice["function"]["name"], text)], "tool_calls"
        return None, [_call(c["name"], c["parameters"]) for c in value], "tool_calls"
    if tool_choice == "auto" and parser == "hermes":
        calls = []
        for block in _HERMES_BLOCK.findall(text):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                continue  # not a call: it stays in the content
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                calls.append(_call(call["name"], call.get("arguments", {})))
        if calls:  # the content is the text before the first block (what a stream showed)
            content = text[:text.find(HERMES_OPEN)]
            return content if content.strip() else None, calls, "tool_calls"
    return text, None, finish_reason


def visible_content(text: str, tool_choice, parser: str | None) -> str:
    """The part of a growing output a stream may show as content now: none of a forced call's text; under the
    Hermes parser, the text before a `<tool_call>` block or before a tail that may start one."""
    if isinstance(tool_choice, dict) or tool_choice == "required":
        return ""
    if tool_choice != "auto" or parser != "hermes":
        return text
    start = text.find(HERMES_OPEN)
    if start >= 0:
        return text[:start]
    for keep in range(len(HERMES_OPEN) - 1, 0, -1):  # a tail that is the start of "<tool_call>" waits
        if text.endswith(HERMES_OPEN[:keep]):
            return text[:-keep]
    return text


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant call's `arguments` JSON text as a mapping (templates
    render it with `tojson`)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[_with_mapping(c) for c in m["tool_calls"]])
        out.append(m)
    return out


def _with_mapping(call: dict) -> dict:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (TypeError, json.JSONDecodeError):
        pass
    return dict(call, function=function)
