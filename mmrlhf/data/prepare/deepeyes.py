"""DeepEyes' RL training data as published on the Hugging Face hub (``ChenShawn/DeepEyes-Datasets-47k``: three
Parquet files in verl's row layout):

- ``prompt``: chat messages ``[{"role", "content"}, ...]``: a system message that writes DeepEyes' own tool schema
  (``image_zoom_in_tool``) and call format into the text, then one user message ``"<image>\\n{question}"`` followed,
  in the tool rows, by DeepEyes' format instruction (``"Think first, call **image_zoom_in_tool** if needed, ..."``);
  a content given as parts (``{"type": "image"}`` / ``{"type": "text"}``) is read too;
- ``images``: a list of ``{"bytes", "path"}``;
- ``reward_model``: ``{"ground_truth", "style"}`` (the reference; ``extra_info.answer`` when it is missing);
- ``data_source``: ``vstar`` (``data_0.1.2_visual_toolbox_v2.parquet``), ``chart``
  (``data_v0.8_visual_toolbox_v2.parquet``), ``thinklite_eureka`` (``data_thinklite_reasoning_acc.parquet``);
  ``env_name`` (``visual_toolbox_v2`` for the tool rows, empty for ThinkLite), ``ability`` and ``extra_info``
  (``question``, ``answer``, ``index``, ...) are not needed.

The system message and the tool-format instruction are DROPPED: here the tools come from the ``agent`` section
through the chat template's own ``tools=`` (with our names: ``image_zoom``, not ``image_zoom_in_tool``), and the
answer format from the recipe's ``data.system_prompt``. A user text that still names ``image_zoom_in_tool`` after
that (an instruction worded differently) is a bad row rather than a prompt asking for a tool that does not exist.

Label by data source: ``deepeyes`` for the V* and chart rows (the recipes score it with ``deepeyes_reward``),
``math`` for the ThinkLite rows (DeepEyes scores them without a tool term); the reference is the published
ground truth (answer tags, if any, removed). Published rows carry no id column: ids are ``deepeyes-<row index>``
over the inputs of one command.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mmrlhf.data.prepare.common import MediaStore, Row, place_items, record, unwrap_answer

LABELS = {"vstar": "deepeyes", "chart": "deepeyes", "vl_agent": "deepeyes", "thinklite_eureka": "math"}
"""``data_source`` -> label, for the sources the release holds (DeepEyes' reward code routes on the same names)."""
TOOL_NAME = "image_zoom_in_tool"
_TOOL_INSTRUCTION = re.compile(r"\s*Think first, call \*\*image_zoom_in_tool\*\*.*\Z", re.DOTALL)


def _messages(row: Row) -> list[dict]:
    messages = row.get("prompt")
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as exc:
            raise row.fail(f"a string that is not a JSON list of messages: {exc}", "prompt") from exc
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise row.fail(f"expected a list of chat messages, got {type(messages).__name__}", "prompt")
    return list(messages)


def _text(content: Any, row: Row) -> str:
    """A message's content as plain text with one ``<image>`` per image part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise row.fail(f"user content is a {type(content).__name__}, expected text or a list of parts", "prompt")
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            pieces.append("<image>")
        elif kind == "text":
            pieces.append(str(part.get("text") or ""))
        else:
            raise row.fail(f"unsupported content part {part!r:.80}", "prompt")
    return "".join(pieces)


def question(row: Row) -> str:
    """The user message's text without DeepEyes' tool-format instruction (system messages are dropped)."""
    users = [m for m in _messages(row) if m.get("role") == "user"]
    if len(users) != 1:
        raise row.fail(f"expected one user message, found {len(users)}", "prompt")
    text = _TOOL_INSTRUCTION.sub("", _text(users[0].get("content"), row)).strip()
    if TOOL_NAME in text:
        raise row.fail(f"the question still names DeepEyes' tool {TOOL_NAME!r} after its known instruction was "
                       "removed; the release's wording differs from what this converter knows", "prompt")
    if not text.replace("<image>", "").strip():
        raise row.fail("the user message has no question text", "prompt")
    return text


def label_of(row: Row) -> str:
    source = row.get("data_source", required=False)
    if source is None:
        raise row.fail(f"missing; expected one of {', '.join(sorted(LABELS))}", "data_source")
    if str(source) not in LABELS:
        raise row.fail(f"unknown data source {source!r}; known: {', '.join(sorted(LABELS))}", "data_source")
    return LABELS[str(source)]


def reference_of(row: Row) -> str:
    for column in ("reward_model", "extra_info"):
        value = row.values.get(column)
        key = "ground_truth" if column == "reward_model" else "answer"
        if isinstance(value, dict) and value.get(key) is not None and str(value[key]).strip():
            return unwrap_answer(str(value[key]))
    raise row.fail("no reference: neither reward_model.ground_truth nor extra_info.answer is set",
                   "reward_model.ground_truth")


def convert_row(row: Row, media: MediaStore) -> dict:
    raw = row.get("images")
    items = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if not items:
        raise row.fail("no image", "images")
    images = [media.image(item, row, "images") for item in items]
    prompt = place_items(question(row), len(images), "<image>", row, "prompt")
    return record(row, "deepeyes", prompt, images=images, label=label_of(row), reference=reference_of(row))
