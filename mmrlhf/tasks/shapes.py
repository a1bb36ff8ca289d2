"""Synthetic visual questions about coloured shapes, made on the fly: the toy task of the quick start.

Three variants, each a single-word answer the tiny tokenizer holds as one token:

- ``colour``: a square filling the image in one of four colours -> "What color is the square?" (chance 0.25);
- ``shape``: a large square or circle on a light background -> "Which shape is in the image?" (chance 0.5);
- ``count``: one to four squares, one per quarter of the image -> "How many objects are in the image?" answered
  with a digit (chance 0.25).

``make_record(index, split=...)`` is a prompt generator for ``data.generator`` (``mmrlhf.tasks.shapes:make_record``):
record ``index`` of a split depends only on ``(seed, split, index)``, so runs are reproducible, resumable and the
``eval`` split never repeats a training image. ``blank=True`` replaces every image with a uniform grey one of the
same size: the control that shows a run learns from the pixels (it must stay near chance).

``first_word_reward`` is the reward function (``type: function``, ``function: mmrlhf.tasks.shapes:first_word_reward``):
1 when the response's first word is the reference, else 0. No partial credit, no knowledge of the answer set.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from PIL import Image, ImageDraw

from mmrlhf.rewards.rules import final_answer

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 205, 40)}
SHAPES = ("square", "circle")
COUNTS = ("1", "2", "3", "4")
QUESTIONS = {
    "colour": "What color is the square? Answer with one word.",
    "shape": "Which shape is in the image? Answer with one word.",
    "count": "How many objects are in the image? Answer with a number.",
}
TASKS = tuple(QUESTIONS)


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int = 25) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)  # type: ignore[return-value]


def draw(task: str, answer: str, rng: random.Random, size: int) -> Image.Image:
    """The image of one question (``answer`` is what it shows). Shapes and squares are placed so that each quarter
    of the image holds one decisive part (a corner of the shape, one counted square): on the tiny models a 56-pixel
    image is four vision tokens, one per quarter, so the answer is visible yet has to be read across tokens."""
    if task == "colour":
        return Image.new("RGB", (size, size), _jitter(COLOURS[answer], rng))
    background = _jitter((235, 235, 235), rng, 15)
    img = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(img)
    fill = _jitter(rng.choice(list(COLOURS.values())), rng)
    if task == "shape":  # a large shape around the centre: a square fills the corners, a circle leaves them empty
        margin = rng.randint(1, max(size // 14, 1))
        box = (margin, margin, size - 1 - margin, size - 1 - margin)
        (pen.rectangle if answer == "square" else pen.ellipse)(box, fill=fill)
        return img
    # count: k of the four quarters hold a square, slightly jittered inside its quarter
    cell = size // 2
    side = max(cell * 2 // 3, 4)
    for c in rng.sample(range(4), int(answer)):
        x0 = (c % 2) * cell + rng.randint(1, cell - side - 1)
        y0 = (c // 2) * cell + rng.randint(1, cell - side - 1)
        pen.rectangle((x0, y0, x0 + side - 1, y0 + side - 1), fill=fill)
    return img


def make_record(index: int, *, split: str = "train", task: str = "colour", size: int = 56,
                blank: bool = False, seed: int = 0) -> dict[str, Any]:
    """Row ``index`` of ``split``: ``{"prompt", "images", "reference", "label", "id"}``.

    ``size``: image side in pixels (56: four vision tokens on the tiny models). ``blank``: the grey-image control.
    """
    if task not in QUESTIONS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    rng = random.Random(f"{seed}:{split}:{task}:{index}")
    answers = {"colour": tuple(COLOURS), "shape": SHAPES, "count": COUNTS}[task]
    answer = rng.choice(answers)
    image = Image.new("RGB", (size, size), (128, 128, 128)) if blank else draw(task, answer, rng, size)
    return {"prompt": "<image>" + QUESTIONS[task], "images": [image], "reference": answer, "label": task,
            "id": f"{task}-{split}-{index}"}


_WORD = re.compile(r"[a-z0-9]+")


def first_word(text: str) -> str:
    """The first run of letters / digits, lower-cased ('' when there is none)."""
    m = _WORD.search(text.lower())
    return m.group(0) if m else ""


def first_word_reward(responses: Sequence[str], prompts: Sequence[str], labels: Sequence[str],
                      references: Sequence[Any]) -> list[float | None]:
    """1.0 when the first word of the response's final answer (after a thinking block, if any) equals the
    reference (case-insensitive), else 0.0; None without a reference (does not apply)."""
    return [None if ref is None else float(first_word(final_answer(resp, prompt)) == str(ref).strip().lower())
            for resp, ref, prompt in zip(responses, references, prompts)]
