"""Tool calls read out of text (`serve/tools.py`): forced calls (a named function, "required") and the Hermes parser
for "auto"; what a stream may show before a call; the constraint a forced call becomes."""

from __future__ import annotations

import json

from flashdraft.serve.tools import forced_calls, read_calls, template_messages, visible_content

NAMED = {"type": "function", "function": {"name": "f"}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]


def test_forced_calls_parse_and_a_cut_call_stays_content():
    content, calls, reason = read_calls('{"x": 3}', NAMED, "stop", None)
    assert content is None and reason == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"x": 3}')]
    content, calls, reason = read_calls('[{"name": "g", "parameters": {}}, {"name": "f", "parameters": {"x": 1}}]',
                                        "required", "stop", None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("g", {}),
                                                                                                 ("f", {"x": 1})]
    assert len({c["id"] for c in calls}) == 2
    assert read_calls('{"x": 3', NAMED, "length", None) == ('{"x": 3', None, "length")
    assert read_calls('{"x": ', NAMED, "stop", None) == ('{"x": ', None, "stop")  # a stop string cut it


def test_hermes_blocks_become_calls_and_the_text_before_them_the_content():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls, reason = read_calls(text, "auto", "stop", "hermes")
    assert content == "Let me check.\n" and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 2}),
                                                                                                 ("g", {})]
    assert read_calls("no calls here", "auto", "stop", "hermes") == ("no calls here", None, "stop")
    assert read_calls("<tool_call>not json</tool_call>", "auto", "stop", "hermes")[1] is None
    assert read_calls(text, "auto", "stop", None) == (text, None, "stop")  # no parser: plain text
    assert read_calls(text, "none", "stop", "hermes") == (text, None, "stop")


def test_streams_hold_back_what_may_start_a_call():
    assert visible_content("Hello <tool", "auto", "hermes") == "Hello "
    assert visible_content("Hello <tool_call>{...", "auto", "hermes") == "Hello "
    assert visible_content("a < b", "auto", "hermes") == "a < b"
    assert visible_content("Hello <", "auto", "hermes") == "Hello "
    assert visible_content("Hello <tool", "auto", None) == "Hello <tool"
    assert visible_content('{"x": 1}', NAMED, None) == "" and visible_content("[", "required", None) == ""


def test_forced_calls_constrain_to_the_tools_schemas():
    named = forced_calls(TOOLS, NAMED, True)
    assert json.loads(named.json_schema) == TOOLS[0]["function"]["parameters"] and not named.any_whitespace
    required = json.loads(forced_calls(TOOLS, "required", False).json_schema)
    assert required["maxItems"] == 1 and required["minItems"] == 1
    assert [item["properties"]["name"]["const"] for item in required["items"]["anyOf"]] == ["f", "g"]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert forced_calls(TOOLS, "auto", True) is None and forced_calls(TOOLS, "none", True) is None


def test_template_messages_give_arguments_as_a_mapping():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    (message,) = template_messages([{"role": "assistant", "tool_calls": [call]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert call["function"]["arguments"] == '{"x": 1}'  # the request itself is not changed
