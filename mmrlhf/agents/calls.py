"""Parsing the tool calls in a policy turn (Qwen's hermes form), strictly: ``json.loads``, never ``eval``.

A call is ``<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>`` (whitespace around the JSON allowed;
``arguments`` given as a JSON string that decodes to an object is accepted too, as some models write it). Text
outside the tags is ignored; a ``</tool_call>`` without an opening tag is text. A turn without any ``<tool_call>``
is the final answer.

Nothing the model writes is dropped or crashes the batch: every malformed block becomes an error observation the
model can learn from (a :class:`~mmrlhf.agents.types.ToolResult` with ``error`` set), and the observation answers
calls and errors in the order they appear (``ParsedTurn.order`` / ``ParsedTurn.items()``). The kinds:

- ``bad_json``: the block is not a JSON object with exactly ``name`` (str) and ``arguments`` (object); also an
  opening tag with no closing tag before the next opening tag or the end of the text. NaN / Infinity and
  duplicate keys are refused (ambiguous);
- ``unknown_tool``: the name is not a configured tool (the message lists the available ones);
- ``bad_arguments``: the arguments fail the tool's JSON schema;
- ``too_many_calls``: a well-formed call beyond ``remaining_calls``. Only well-formed calls use up the budget
  (the trajectory counts the calls it made); malformed ones are answered with their own error.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from mmrlhf.agents.tool_base import Tool, validate_arguments
from mmrlhf.agents.types import ParsedTurn, ToolCall, ToolResult

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_FORM = '<tool_call>{"name": <tool name>, "arguments": {...}}</tool_call>'
_MAX_QUOTE = 80


class _CallError(Exception):
    """Internal: one block's failure (kind, message for the model)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise _CallError("bad_json", "Error: the tool call is nested too deeply to parse.") from None
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise _CallError("bad_json", f"Error: the tool call is not valid JSON ({reason}). Write {_FORM}.") \
            from None


def _decode(body: str) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` of one block's text, or _CallError(bad_json)."""
    obj = _loads(body.strip())
    if not isinstance(obj, dict):
        raise _CallError("bad_json", f"Error: a tool call must be a JSON object, got a JSON {_json_type(obj)}. "
                                     f"Write {_FORM}.")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        raise _CallError("bad_json", f"Error: unexpected key(s) {', '.join(map(repr, extra))} in the tool call; "
                                     f"give only \"name\" and \"arguments\": {_FORM}.")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _CallError("bad_json", f"Error: the tool call needs a \"name\" string. Write {_FORM}.")
    if "arguments" not in obj:
        raise _CallError("bad_json", f"Error: the call of {_quote(name)} needs an \"arguments\" object (use {{}} "
                                     "for none).")
    arguments = obj["arguments"]
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        raise _CallError("bad_json", f"Error: the \"arguments\" of {_quote(name)} must be a JSON object, got a "
                                     f"JSON {_json_type(arguments)}.")
    return name, arguments


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {list: "array", str: "string", int: "number", float: "number", type(None): "null"}.get(type(value),
                                                                                                "value")


def _quote(name: str) -> str:
    return repr(name if len(name) <= _MAX_QUOTE else name[:_MAX_QUOTE] + "...")


def _check(name: str, arguments: dict[str, Any], tools: Mapping[str, Tool]) -> None:
    if name not in tools:
        available = ", ".join(tools) or "none"
        raise _CallError("unknown_tool", f"Error: unknown tool {_quote(name)}. Available tools: {available}.")
    problem = validate_arguments(tools[name], arguments)
    if problem is not None:
        raise _CallError("bad_arguments", f"Error: bad arguments for {name}: {problem}.")


def _blocks(text: str) -> list[str | None]:
    """The text of each ``<tool_call>`` block in order; None for an opening tag not closed before the next one
    (or the end)."""
    blocks: list[str | None] = []
    pos = 0
    while (start := text.find(OPEN_TAG, pos)) != -1:
        body_start = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body_start)
        next_open = text.find(OPEN_TAG, body_start)
        if end == -1 or (next_open != -1 and next_open < end):
            blocks.append(None)
            if end == -1:
                break
            pos = next_open
            continue
        blocks.append(text[body_start:end])
        pos = end + len(CLOSE_TAG)
    return blocks


def parse_turn(text: str, tools: Mapping[str, Tool], *, remaining_calls: int) -> ParsedTurn:
    """The calls and parse errors of one policy turn, in order (see the module docstring).

    ``tools``: the configured tools by name; ``remaining_calls``: how many more calls the trajectory may make
    (``agent.max_tool_calls`` minus the calls made so far)."""
    if remaining_calls < 0:
        raise ValueError(f"remaining_calls must be >= 0, got {remaining_calls}")
    turn = ParsedTurn()
    for body in _blocks(text):
        try:
            if body is None:
                raise _CallError("bad_json", f"Error: a {OPEN_TAG} was not closed by {CLOSE_TAG}. Write {_FORM}.")
            name, arguments = _decode(body)
            _check(name, arguments, tools)
            if len(turn.calls) >= remaining_calls:
                raise _CallError("too_many_calls", f"Error: no tool calls left for {name} (the limit of tool "
                                                   "calls is reached); answer without calling a tool.")
        except _CallError as exc:
            turn.order.append(("error", len(turn.errors)))
            turn.errors.append(ToolResult(text=exc.message, error=exc.kind))
            continue
        turn.order.append(("call", len(turn.calls)))
        turn.calls.append(ToolCall(name=name, arguments=arguments, raw=body))
    return turn
