"""Prompt shapes: count vision slots, turn placeholder text into chat messages, render the text to tokenise.

A prompt is plain text with one ``<image>`` / ``<video>`` placeholder per item, or chat messages whose content
parts say where each image / video goes. Both become chat messages whose parts keep the placeholders' order, so
image k of a record is the k-th image part: the processor then lines up images and pad tokens in that order.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

from mmrlhf.data.types import Prompt

logger = logging.getLogger(__name__)


def part_kind(part: Any) -> Optional[str]:
    """``"image"`` / ``"video"`` / ``"text"`` for a content part (``{"type": ..}`` or a bare ``{"image": ..}``)."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind in ("image", "image_url"):
        return "image"
    if kind == "video":
        return "video"
    if kind == "text":
        return "text"
    if "image" in part or "image_url" in part:
        return "image"
    if "video" in part:
        return "video"
    return "text" if "text" in part else None


def iter_parts(messages: list):
    """Content parts of every message, in order (string contents yield one text part)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield {"type": "text", "text": content}
        elif isinstance(content, list):
            yield from content


def count_slots(prompt: Prompt, image_placeholder: str, video_placeholder: str) -> tuple[int, int]:
    """(images, videos) the prompt has places for."""
    if isinstance(prompt, str):
        return prompt.count(image_placeholder), prompt.count(video_placeholder)
    kinds = [part_kind(p) for p in iter_parts(prompt)]
    return kinds.count("image"), kinds.count("video")


class PromptRenderer:
    """Renders prompts to the exact text that is tokenised (chat template applied, or not, by configuration)."""

    def __init__(self, template_owner: Any, *, apply_chat_template: bool = True, image_placeholder: str = "<image>",
                 video_placeholder: str = "<video>", system_prompt: Optional[str] = None,
                 image_sequence: str = "", video_sequence: str = "",
                 template_kwargs: Optional[dict[str, Any]] = None) -> None:
        # ``template_owner``: the processor (or tokenizer) whose ``apply_chat_template`` renders messages.
        self.owner = template_owner
        self.apply_chat_template = apply_chat_template
        self.image_placeholder = image_placeholder
        self.video_placeholder = video_placeholder
        self.system_prompt = system_prompt
        self.configured_kwargs = dict(template_kwargs or {})  # data.chat_template_kwargs (e.g. enable_thinking)
        self._template_kwargs: Optional[dict[str, Any]] = None  # those the owner's template reads (first render)
        # Without a chat template, placeholders become the model's own vision sequence
        # (``<|vision_start|><|image_pad|><|vision_end|>``), which the processor then expands.
        self.image_sequence = image_sequence
        self.video_sequence = video_sequence
        self._split = re.compile(f"({re.escape(image_placeholder)}|{re.escape(video_placeholder)})")
        self.tools: Optional[list[dict]] = None  # function schemas rendered through the template's ``tools=``
        self._template_takes_tools: Optional[bool] = None

    def to_messages(self, prompt: Prompt) -> list:
        """Chat messages for ``prompt``; plain text becomes one user turn (after the system prompt, if any)."""
        if not isinstance(prompt, str):
            return [_clean_message(m) for m in prompt]
        if self.image_placeholder in prompt or self.video_placeholder in prompt:
            parts = []
            for piece in self._split.split(prompt):
                if piece == self.image_placeholder:
                    parts.append({"type": "image"})
                elif piece == self.video_placeholder:
                    parts.append({"type": "video"})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            content: Any = parts
        else:
            content = prompt
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The configured template variables that the owner's chat template reads (:func:`template_variables`).

        Why not all of them: a processor's ``apply_chat_template`` takes a variable its template does not read for
        a processor argument and warns at every call (3,840 identical lines in a 200-step toy run whose recipe sets
        ``enable_thinking`` for the families that read it); a tokenizer's passes it on unread. Either way the
        variable does nothing, so it is left out, said once at INFO level."""
        if self._template_kwargs is None:
            declared = template_variables(getattr(self.owner, "chat_template", None))
            self._template_kwargs = {k: v for k, v in self.configured_kwargs.items()
                                     if declared is None or k in declared}
            unread = sorted(set(self.configured_kwargs) - set(self._template_kwargs))
            if unread:
                logger.info("data.chat_template_kwargs: this model's chat template does not read %s; left out",
                            ", ".join(unread))
        return self._template_kwargs

    def render(self, prompt: Prompt) -> str:
        if self.apply_chat_template:
            messages = self.to_messages(prompt)
            if self.tools:
                return self._render_with_tools(messages)
            return self.owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **self.template_kwargs)
        if not isinstance(prompt, str):
            raise ValueError("chat-message prompts need data.apply_chat_template=true")
        return (prompt.replace(self.image_placeholder, self.image_sequence)
                .replace(self.video_placeholder, self.video_sequence))


    def _render_with_tools(self, messages: list) -> str:
        """The template's own ``tools=`` rendering; a template that ignores ``tools`` (Qwen2-VL's and Qwen2.5-VL's
        processor templates do) gets them as a system message instead (:func:`tools_system_text`), so the policy
        is always told what it may call."""
        plain = self.owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               **self.template_kwargs)
        text = self.owner.apply_chat_template(messages, tools=self.tools, tokenize=False, add_generation_prompt=True,
                                              **self.template_kwargs)
        if text != plain:
            return text
        system = tools_system_text(self.tools)
        if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
            messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": system}, *messages]
        return self.owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              **self.template_kwargs)


def template_variables(chat_template: Any) -> Optional[frozenset[str]]:
    """The variables a Jinja chat template reads from its caller (besides the messages); None when there is no
    template string to inspect, or one this parser cannot read (a custom tag): the caller then passes every variable
    on. A processor or tokenizer with several named templates renders the ``default`` one."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    if not isinstance(chat_template, str):
        return None
    import jinja2
    import jinja2.ext
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(chat_template)
    except jinja2.TemplateError:
        return None
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


def tools_system_text(tools: list[dict]) -> str:
    """Hermes-style tool instructions for templates without ``tools=`` support: one JSON schema per line inside
    ``<tools>``, and the call form."""
    import json

    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call these functions to help with the request:\n<tools>\n" + lines +
            "\n</tools>\n\nTo call one, write a JSON object with its name and arguments inside <tool_call></tool_call>"
            ' tags, e.g.:\n<tool_call>\n{"name": "<function-name>", "arguments": {...}}\n</tool_call>')


def _clean_message(message: dict) -> dict:
    """A message whose parts are bare ``{"type": ..}`` markers (and text).

    Why: chat templates test ``'image' in part``, and Parquet / ``datasets`` store every part with every key (a text
    part gets ``"image": None``), which would render a phantom image; item payloads (paths, PIL images) have no
    business in the template either."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        kind = part_kind(part)
        if kind in ("image", "video"):
            parts.append({"type": kind})
        elif kind == "text":
            parts.append({"type": "text", "text": part.get("text") or ""})
    return {**message, "content": parts}
