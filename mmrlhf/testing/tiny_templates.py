"""The tiny models' chat templates (:mod:`mmrlhf.testing.tiny_models`): Qwen-style turns, the tool-calling variant and
Qwen3.5's thinking opening. Part of the factory's cache hash (every ``tiny_*.py`` of this folder is)."""

from __future__ import annotations

# Chat template: Qwen-style turns; content may be a string or a list of parts ({"type": "image" | "video" |
# "text", ...}); each image/video part becomes <|vision_start|><|image_pad|><|vision_end|> (the processor expands
# the pad token to the image's merged-patch count). No default system prompt: tiny vocabularies stay short.
# _MESSAGE_BODY is one message's opening and content, shared with the tool variant's template.
_MESSAGE_BODY = (
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
_GENERATION_PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
CHAT_TEMPLATE = (
    "{% for message in messages %}" + _MESSAGE_BODY + "<|im_end|>\n{% endfor %}" + _GENERATION_PROMPT
)


# The tool variant's template: the plain one, plus ``tools=`` rendered as a short system turn (names only: tiny
# contexts), assistant ``tool_calls`` as hermes tags, and ``tool`` messages grouped into one user turn of
# <tool_response> blocks, images first, as mmrlhf.agents.template renders observations. A newline right after a
# block tag is written as {{ '\\n' }}: HF renders templates with trim_blocks, which would eat a literal one.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}" + _MESSAGE_BODY +
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}" + _GENERATION_PROMPT
)

# Qwen3.5's two modes, as its released template writes the assistant's opening: thinking (the default) opens a
# ``<think>`` block for the model to close; ``enable_thinking=False`` writes an empty block, so the model answers
# at once. Rewards read the final answer after the block (mmrlhf.rewards.rules.final_answer).
_THINKING_PROMPT = ("{% if add_generation_prompt %}<|im_start|>assistant\n"
                    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                    "{% else %}<think>\n{% endif %}{% endif %}")


def chat_template(*, tools: bool = False, thinking: bool = False) -> str:
    """A tiny model's chat template: the plain or tool-calling turns, with Qwen3.5's thinking opening where the
    family has it (``thinking``)."""
    template = TOOLS_TEMPLATE if tools else CHAT_TEMPLATE
    return template.replace(_GENERATION_PROMPT, _THINKING_PROMPT) if thinking else template
