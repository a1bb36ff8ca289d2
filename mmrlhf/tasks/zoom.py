"""A visual task that needs the zoom tool: the quick start of multi-turn, tool-using training (docs/agents.md).

Each image is a fine checkerboard of one colour and its complement (red / cyan, green / magenta, blue / yellow,
black / white), one pixel per square, at ``size`` pixels (default 112). The recipe caps prompt images at a quarter
of that area (``data.image_max_pixels: 3136``, 56 x 56), and halving a one-pixel checkerboard averages every pair of
squares: the model's first view is the same uniform grey for every answer (measured: every channel 128 +- 0.1 for
all four), so without the tool the best policy is chance (0.25). The zoom tool crops the ORIGINAL image: a quarter
of it is 56 x 56 source pixels, which the processor keeps as they are, so the squares and their colours are there
to read. The answer is the first colour word of the pair (``red``, ``green``, ``blue``, ``black``).

``blank=True`` is for the tool, not the task: configure the zoom tool with ``options: {blank: true}`` (it then
returns uniform grey crops) for the control that must stay at chance.

``make_record(index, split=...)`` is a prompt generator (``data.generator: mmrlhf.tasks.zoom:make_record``): record
``index`` of a split depends only on ``(seed, split, index)``. Each record varies the contrast; the checkerboard's
phase is fixed (the colour on even squares), so what the crop shows is one pattern per answer. There are about a
hundred distinct images, so the eval split repeats training images: harmless here, since the first view cannot
tell them apart (the eval measures reading the crop, which needs the call).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from PIL import Image

PAIRS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "black": (0, 0, 0)}
QUESTION = "Which color is in the pattern? Answer with one word."


def draw(answer: str, rng: random.Random, size: int) -> Image.Image:
    """The checkerboard of ``answer``'s colour and its complement, contrast in [0.8, 1] around mid grey."""
    colour = np.array(PAIRS[answer], dtype=np.float64)
    mid, amount = 127.5, rng.uniform(0.8, 1.0)
    first, second = mid + amount * (colour - mid), mid + amount * ((255.0 - colour) - mid)
    yy, xx = np.mgrid[0:size, 0:size]
    squares = ((xx + yy) % 2 == 0)[..., None]  # [size, size, 1] the colour on even squares, its complement on odd
    pixels = np.where(squares, first, second)  # [size, size, 3]
    return Image.fromarray(np.clip(np.round(pixels), 0, 255).astype(np.uint8))


def make_record(index: int, *, split: str = "train", size: int = 112, seed: int = 0) -> dict[str, Any]:
    """Row ``index`` of ``split``: ``{"prompt", "images", "reference", "label", "id"}``."""
    if size < 56 or size % 2:
        raise ValueError(f"size must be an even number of at least 56 pixels, got {size}")
    rng = random.Random(f"{seed}:{split}:zoom:{index}")
    answer = rng.choice(tuple(PAIRS))
    return {"prompt": "<image>" + QUESTION, "images": [draw(answer, rng, size)], "reference": answer,
            "label": "zoom", "id": f"zoom-{split}-{index}"}
