"""Whole tool calls as single tokens of a tiny tool-calling model (``tiny_model_dir(tools=True, ...)``).

Why whole calls: a tiny random policy over hundreds of tokens practically never writes a well-formed hermes call
token by token, so a toy task could never show a tool being learned. With the call as ONE added token (and
``rollout.allowed_tokens`` restricted to the task's few tokens, as the zoom toy recipe does) the policy calls in
one sample of a few from the start. The zoom toy task's call is built in (``TOY_CALL_TOKEN``); these helpers turn a
user's own calls into the same form, so their tool can be tried on a tiny model too.

A call's token is the canonical text ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``json.dumps``
with its default separators, the form of the zoom token): the agent's parser reads it as any other call, and the
engine stops after it on the ``</tool_call>`` stop string.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping, Sequence


def call_token(call: str | Mapping[str, Any]) -> str:
    """The added token of ``call`` (``{"name": str, "arguments": dict}``, as a mapping or its JSON text)."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call {call!r} is not JSON: {exc}") from exc
    if not isinstance(call, Mapping) or set(call) != {"name", "arguments"}:
        raise ValueError(f'a tool call is {{"name": ..., "arguments": {{...}}}}, got {call!r}')
    name, arguments = call["name"], call["arguments"]
    if not isinstance(name, str) or not name or not isinstance(arguments, Mapping):
        raise ValueError(f"a tool call needs a non-empty string name and an arguments object, got {call!r}")
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def user_call_tokens(tool_calls: Sequence[str | Mapping[str, Any]] = (),
                     tool_names: Sequence[str] = ()) -> list[str]:
    """The tokens of ``tool_calls`` then of one argument-less call per name of ``tool_names``, in order; the same
    call twice is refused (it would name one token twice)."""
    tokens = [call_token(c) for c in tool_calls] + [call_token({"name": n, "arguments": {}}) for n in tool_names]
    seen: set[str] = set()
    for token in tokens:
        if token in seen:
            raise ValueError(f"tool call {token!r} is given twice")
        seen.add(token)
    return tokens


def variant_suffix(tokens: Sequence[str]) -> str:
    """The cache-name part of a model with ``tokens`` added: ``""`` for none (the plain tool variant keeps its
    name), else the calls' tool names (readable, made filename-safe) and a hash of the exact calls in order (two
    sets of calls of one tool differ)."""
    if not tokens:
        return ""
    names = []
    for token in tokens:
        name = json.loads(token[len("<tool_call>"):-len("</tool_call>")])["name"]
        safe = re.sub(r"[^A-Za-z0-9_.]+", "_", name)[:24]
        if safe not in names:
            names.append(safe)
    digest = hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:8]
    return f"-{'+'.join(names)[:64]}-{digest}"
