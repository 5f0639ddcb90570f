"""Tool calls parsed from a sampled reply in Qwen's ``<tool_call>`` format, as the OpenAI API
returns them; anything malformed stays text."""

from __future__ import annotations

import json

from marin_rl_core.rollout.tool_calls import parse_tool_calls


def test_a_qwen_tool_call_becomes_an_openai_tool_call():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    parsed = parse_tool_calls(text, call_id_prefix="ep7")
    assert parsed.content == "Let me add."
    [call] = parsed.tool_calls
    assert call["id"] == "ep7_0" and call["type"] == "function"
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}


def test_several_calls_and_no_prose():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b"]
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]
    assert parsed.tool_calls[1]["function"]["arguments"] == '{"x": 1}'


def test_malformed_blocks_stay_text():
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "a"',
        "plain answer 42",
    ):
        parsed = parse_tool_calls(text)
        assert parsed.tool_calls == [] and parsed.content == text
