"""Parsing a policy turn's tool calls (hermes form): strict JSON, every failure an ordered error observation."""

from __future__ import annotations

import json
import re

import pytest

from mmrlhf.agents.calls import parse_turn
from mmrlhf.agents.tools import build_tools
from mmrlhf.agents.types import ParsedTurn, ToolCall, ToolResult

TOOLS = build_tools(["image_zoom", "calculator"])


def call(name: str, arguments, *, as_string: bool = False) -> str:
    args = json.dumps(arguments) if as_string else arguments
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def parse(text: str, remaining: int = 8):
    return parse_turn(text, TOOLS, remaining_calls=remaining)


def test_no_tags_is_final_and_text_outside_tags_is_ignored():
    turn = parse("The answer is 42. </tool_call> stray closing tags are text.")
    assert turn.is_final and turn.items() == []
    turn = parse("Let me zoom. " + call("image_zoom", {"bbox_2d": [1, 2, 30, 40]}) + " trailing junk")
    assert not turn.is_final
    assert turn.calls == [ToolCall("image_zoom", {"bbox_2d": [1, 2, 30, 40]}, raw=turn.calls[0].raw)]
    assert json.loads(turn.calls[0].raw)["name"] == "image_zoom" and not turn.errors


def test_arguments_given_as_a_json_string_are_accepted():
    turn = parse(call("calculator", {"expression": "1+1"}, as_string=True))
    assert turn.calls[0].arguments == {"expression": "1+1"} and not turn.errors


@pytest.mark.parametrize("body, match", [
    ("{'name': 'calculator', 'arguments': {}}", "not valid JSON"),  # Python literal, not JSON: never eval'd
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
    ("", "not valid JSON"),
    ('["calculator", {}]', "must be a JSON object, got a JSON array"),
    ('{"arguments": {}}', "needs a \"name\" string"),
    ('{"name": 3, "arguments": {}}', "needs a \"name\" string"),
    ('{"name": "calculator"}', "needs an \"arguments\" object"),
    ('{"name": "calculator", "arguments": [1]}', "must be a JSON object, got a JSON array"),
    ('{"name": "calculator", "arguments": "not json"}', "not valid JSON"),
    ('{"name": "calculator", "arguments": "[1, 2]"}', "must be a JSON object"),
    ('{"name": "calculator", "parameters": {}, "arguments": {}}', "unexpected key.*'parameters'"),
    ('{"name": "calculator", "arguments": {"expression": NaN}}', "NaN is not a number"),
    ('{"name": "calculator", "name": "image_zoom", "arguments": {}}', "duplicate key 'name'"),
    ("[" * 100_000, "nested too deeply|not valid JSON"),
])
def test_bad_json_becomes_an_error_observation(body, match):
    turn = parse(f"<tool_call>{body}</tool_call>")
    assert not turn.calls and not turn.is_final
    assert [e.error for e in turn.errors] == ["bad_json"]
    assert turn.errors[0].text.startswith("Error: ")
    assert re.search(match, turn.errors[0].text), turn.errors[0].text


def test_unknown_tool_lists_the_available_ones():
    turn = parse(call("zom", {}))
    assert turn.errors == [ToolResult(text="Error: unknown tool 'zom'. Available tools: image_zoom, calculator.",
                                      error="unknown_tool")]


def test_bad_arguments_name_the_problem():
    turn = parse(call("image_zoom", {"bbox_2d": [1, 2, 3]}))
    assert turn.errors[0].error == "bad_arguments"
    assert "image_zoom" in turn.errors[0].text and "bbox_2d" in turn.errors[0].text


def test_unterminated_calls_are_bad_json_and_the_next_call_still_parses():
    turn = parse('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}')
    assert [e.error for e in turn.errors] == ["bad_json"] and "not closed" in turn.errors[0].text
    turn = parse('<tool_call>{"name": "calc' + call("calculator", {"expression": "2"}))
    assert [e.error for e in turn.errors] == ["bad_json"]
    assert turn.calls[0].arguments == {"expression": "2"}
    assert turn.order == [("error", 0), ("call", 0)]


def test_several_calls_and_errors_keep_their_order():
    text = (call("calculator", {"expression": "1"}) + " then " + call("nope", {}) + "\n"
            + call("image_zoom", {"bbox_2d": [0, 0, 10, 10]}) + "<tool_call>{oops}</tool_call>"
            + call("calculator", {"expression": "2"}))
    turn = parse(text)
    assert turn.order == [("call", 0), ("error", 0), ("call", 1), ("error", 1), ("call", 2)]
    kinds = [i.name if isinstance(i, ToolCall) else i.error for i in turn.items()]
    assert kinds == ["calculator", "unknown_tool", "image_zoom", "bad_json", "calculator"]


def test_calls_past_the_remaining_budget_are_too_many_calls():
    text = "".join(call("calculator", {"expression": str(i)}) for i in range(4))
    turn = parse(text, remaining=2)
    assert [c.arguments["expression"] for c in turn.calls] == ["0", "1"]
    assert [e.error for e in turn.errors] == ["too_many_calls", "too_many_calls"]
    assert turn.order == [("call", 0), ("call", 1), ("error", 0), ("error", 1)]
    # malformed blocks do not use up the budget (they are answered with their own error)
    turn = parse("<tool_call>{</tool_call>" + call("calculator", {"expression": "1"}), remaining=1)
    assert len(turn.calls) == 1 and [e.error for e in turn.errors] == ["bad_json"]
    assert [e.error for e in parse(call("calculator", {"expression": "1"}), remaining=0).errors] == [
        "too_many_calls"]
    with pytest.raises(ValueError, match="remaining_calls"):
        parse("", remaining=-1)


def test_items_without_order_lists_calls_then_errors():
    turn = ParsedTurn(calls=[ToolCall("a", {})], errors=[ToolResult(error="bad_json")])
    assert [type(i).__name__ for i in turn.items()] == ["ToolCall", "ToolResult"]
