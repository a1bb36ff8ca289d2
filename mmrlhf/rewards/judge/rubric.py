"""Rubric rendering: one chat message (text + image parts, in the template's order) per sample to judge.

The rubric is a Jinja template over ``question``, ``reference`` (None where the sample has none), ``answer`` (the
response's final answer: a thinking block is stripped, because the judge should grade the answer, not reasoning
that may try out wrong candidates) and ``images`` (one marker string per image; printing a marker places that image
there). Images the template does not place are put before the text, as a VLM chat usually shows them.

The message is OpenAI-shaped (``image_url`` parts carrying base64 PNG data URLs) because both backends take that
shape: ``vllm serve`` and other endpoints through the HTTP API, and ``vllm.LLM.chat`` in process.

The variables are data, never control (:func:`escape_text`). Every backend renders the message with the judge's
chat template and tokenises the result with its special tokens recognised (a vLLM server, ``LLM.chat``), so a
policy's answer holding ``<|im_end|>`` would end the judge's user turn and open a forged one, and vision tokens
would add image placeholders with no image behind them; an answer holding this module's own image marker would
place an image (or make the request fail, which with ``reward.on_failure: error`` stops the run). Token-level
escaping is not available through a text API, so the strings are broken in the text: one space after their first
character, which no tokenizer reads as the token and the judge still reads as the same, odd, text. Broken are: the
image marker, the chat-control shape ``<|name|>`` (also with full-width bars) that the ChatML-style families share,
and every special token of the judge's own tokenizer when it is known (``reserved``: the judge model is a local
folder). The rubric itself is the user's and is not escaped.

Encoding an image is most of the cost of a request (a 448 px PNG takes tens of ms), and the n samples of a GRPO
group share their prompt's images (the same objects), so :class:`ImageParts` encodes each image object once per
scoring call and hands every sample that shows it the same part (the endpoint client serialises a shared part once
too). PNG at zlib level 1: as lossless as level 6, about twice as fast, about 10% more bytes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mmrlhf.rewards.rules import final_answer
from mmrlhf.rewards.wire import encode_image

DEFAULT_RUBRIC = (
    "{% for image in images %}{{ image }}{% endfor %}"
    "You are grading an answer to a question about the image{{ 's' if images|length > 1 else '' }}.\n"
) + """Question: {{ question }}
{% if reference is not none %}Reference answer: {{ reference }}
{% endif %}Answer to grade: {{ answer }}
Is the answer correct? Reply with one word: yes or no."""
"""The built-in rubric: a yes / no verdict on the answer, against the reference when there is one."""

_MARKER = "<<judge-image-{}>>"
_MARKER_RE = re.compile(r"<<judge-image-(\d+)>>")
_VISION_SPAN = re.compile(r"<\|vision_start\|>.*?<\|vision_end\|>", re.S)
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")
# What :func:`escape_text` breaks besides the judge's own special tokens: this module's image marker, and the
# chat-control shape <|name|> (ASCII or full-width bars) of the ChatML-style families.
_ALWAYS = (r"<<judge-image-\d+>>", r"<[|\uff5c][^<>|\uff5c\s]{1,64}[|\uff5c]>")


@dataclass
class JudgeRequest:
    """One judge call: the user message (OpenAI content parts) and the digest that identifies it for the cache."""

    content: list[dict[str, Any]]
    text: str
    """The rendered text with image markers, for the report and error messages."""
    image_digests: list[str] = field(default_factory=list)
    """sha256 of each image's PNG bytes, in order."""


def load_rubric(rubric: str) -> str:
    """The template text: ``rubric`` itself, the built-in one when empty, or a file's text when it names an
    existing ``.j2`` / ``.jinja`` / ``.txt`` file (a missing such file is an error naming it)."""
    if not rubric:
        return DEFAULT_RUBRIC
    if rubric.endswith((".j2", ".jinja", ".txt")) and "\n" not in rubric:
        path = Path(rubric).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"judge rubric file {path} not found")
        return path.read_text()
    return rubric


def compile_rubric(template_text: str):
    """A Jinja template with ``StrictUndefined``: a misspelled variable is an error, not an empty string."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)
    return env.from_string(template_text)


def rubric_digest(template_text: str) -> str:
    return hashlib.sha256(template_text.encode()).hexdigest()[:16]


def question_from_prompt(prompt: str) -> str:
    """The last user turn of a chat-templated prompt (Qwen's ``<|im_start|>user ... <|im_end|>``), vision blocks
    and special tokens removed; a prompt without that shape is returned whole, special tokens removed."""
    turns = prompt.split("<|im_start|>user")
    text = turns[-1].split("<|im_end|>", 1)[0] if len(turns) > 1 else prompt
    return _SPECIAL.sub("", _VISION_SPAN.sub("", text)).strip()


def escaper(reserved: Sequence[str] = ()) -> re.Pattern:
    """The pattern :func:`escape_text` breaks: the image marker, the chat-control shape, and ``reserved`` (the
    judge tokenizer's special tokens; single characters cannot be broken and are left out)."""
    words = sorted({w for w in reserved if len(w) > 1}, key=len, reverse=True)
    return re.compile("|".join([*map(re.escape, words), *_ALWAYS]))


def escape_text(value: Any, pattern: re.Pattern) -> Any:
    """``value`` with every match of ``pattern`` (:func:`escaper`) broken by a space after its first character;
    strings inside lists, tuples and dicts too (a reference may be one), anything else as it is."""
    if isinstance(value, str):
        return pattern.sub(lambda m: m.group(0)[0] + " " + m.group(0)[1:], value)
    if isinstance(value, (list, tuple)):
        return type(value)(escape_text(v, pattern) for v in value)
    if isinstance(value, dict):
        return {escape_text(k, pattern): escape_text(v, pattern) for k, v in value.items()}
    return value


def judge_special_tokens(model: str) -> list[str]:
    """The special tokens of the judge's tokenizer when ``model`` is a local folder holding one, else ``[]`` (an
    endpoint's model name: only the shapes of :data:`_ALWAYS` are then escaped)."""
    if not model or not Path(model).expanduser().is_dir():
        return []
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(Path(model).expanduser()))
    except (OSError, ValueError):  # a model folder without a tokenizer: the shapes still apply
        return []
    special = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special}
    return sorted(special | set(tok.all_special_tokens))


class ImageParts:
    """Each image's message part and digest, made once per image object for as long as this object lives (one
    scoring call): a batch of 32 prompts x 8 samples with one image each encodes 32 PNGs, not 256. The image is
    held, so its ``id`` cannot be reused by another object meanwhile."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Any, dict[str, Any], str]] = {}
        self.encoded = 0
        """How many images were encoded (the rest were shared)."""

    def __call__(self, image: Any) -> tuple[dict[str, Any], str]:
        """(the ``image_url`` part, the digest of its PNG) of ``image``."""
        made = self._made.get(id(image))
        if made is None:
            data = encode_image(image, compress_level=1)
            part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
            made = self._made[id(image)] = (image, part, hashlib.sha256(data.encode("ascii")).hexdigest()[:16])
            self.encoded += 1
        return made[1], made[2]


def render_request(template, *, question: str, reference: Any, response: str, prompt: str,
                   images: list[Any], escape: re.Pattern | None = None,
                   parts: ImageParts | None = None) -> JudgeRequest:
    """The judge request for one sample (``template`` from :func:`compile_rubric`); ``question``, ``reference``
    and the answer are escaped with ``escape`` (default: :func:`escaper` without reserved tokens); ``parts``
    shares the encoded images between the samples of one call (a fresh one per request when not given)."""
    escape = escape or _DEFAULT_ESCAPE
    parts = parts or ImageParts()
    markers = [_MARKER.format(i) for i in range(len(images))]
    text = template.render(question=escape_text(question, escape), reference=escape_text(reference, escape),
                           answer=escape_text(final_answer(response, prompt).strip(), escape), images=markers)
    encoded = [parts(img) for img in images]
    placed: set[int] = set()
    content: list[dict[str, Any]] = []
    pos = 0
    for match in _MARKER_RE.finditer(text):
        index = int(match.group(1))
        if index >= len(images):
            raise ValueError(f"the rubric placed image {index} but the sample has {len(images)} image(s)")
        if text[pos:match.start()]:
            content.append({"type": "text", "text": text[pos:match.start()]})
        content.append(encoded[index][0])
        placed.add(index)
        pos = match.end()
    if text[pos:]:
        content.append({"type": "text", "text": text[pos:]})
    unplaced = [encoded[i][0] for i in range(len(images)) if i not in placed]
    return JudgeRequest(content=unplaced + content, text=text, image_digests=[digest for _, digest in encoded])


_DEFAULT_ESCAPE = escaper()
