"""Bounding boxes the policy writes, mapped to pixels of the ORIGINAL image (the one a zoom tool crops).

Why this matters: Qwen-VL families write boxes in different spaces, and cropping in the wrong one silently cuts the
wrong region (a peer's zoom tool cropped the original image with resized-image coordinates: 12% off). The space is
``ToolContext.box_space``:

- ``"relative1000"`` (Qwen2-VL, Qwen3-VL): 0-1000 of the image's width and height, whatever its resolution.
  ``source = box / 1000 * source_size``.
  Example: a 2000x1000 source, box ``[250, 100, 500, 600]`` -> ``(500, 100, 1000, 600)``.
- ``"absolute"`` (Qwen2.5-VL): pixels of the image AS THE MODEL SAW IT, i.e. after the processor's resize
  (``ToolContext.model_image_sizes[i]``). ``source = box / model_size * source_size``, per axis.
  Example: a 2000x1000 source the processor resized to 1008x504, box ``[252, 50, 504, 302]`` ->
  ``252 / 1008 * 2000 = 500``, ``50 / 504 * 1000 = 99.2``, ``1000``, ``599.2`` -> ``(500, 99, 1000, 600)``.

The rule, in order:

1. the box must be 4 finite numbers ``[x0, y0, x1, y1]`` (booleans are not numbers);
2. it is mapped to source pixels (floats), then corners are ordered (``x0 <= x1``, ``y0 <= y1``: a box written
   right-to-left is the same region) and clamped into ``[0, width] x [0, height]``;
3. a box of zero width or height after that (written degenerate, or lying wholly outside the image) is refused;
4. the float edges become whole pixels covering every touched pixel (``floor`` the start, ``ceil`` the end, with a
   1e-6 tolerance so ``599.9999999`` is ``600``); the end is exclusive, as in ``PIL.Image.crop``;
5. a side shorter than ``min_side`` source pixels is grown symmetrically around its centre to ``min_side`` (or the
   image's side, if smaller), shifted to stay inside the image.

Errors the model caused raise :class:`BoxError` (its message is written for the model); a wrong ``space`` or
missing sizes are the caller's bug and raise a plain ValueError.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

BOX_SPACES = ("relative1000", "absolute")
_EPS = 1e-6


class BoxError(ValueError):
    """A box the model wrote that names no region of the image; the message is meant for the model."""


def _size(value: Any, what: str) -> tuple[int, int]:
    try:
        width, height = value
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be (width, height), got {value!r}") from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (width, height)):
        raise ValueError(f"{what} must be two positive numbers, got {value!r}")
    return width, height


def _numbers(box: Any) -> tuple[float, float, float, float]:
    if isinstance(box, (str, bytes)) or not isinstance(box, Sequence) or len(box) != 4:
        raise BoxError(f"a box must be a list of 4 numbers [x0, y0, x1, y1], got {box!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
        raise BoxError(f"a box must be a list of 4 numbers [x0, y0, x1, y1], got {box!r}")
    if not all(math.isfinite(v) for v in box):
        raise BoxError(f"box coordinates must be finite numbers, got {box!r}")
    x0, y0, x1, y1 = (float(v) for v in box)
    return x0, y0, x1, y1


def _grow(start: int, end: int, min_side: int, limit: int) -> tuple[int, int]:
    """Grow ``[start, end)`` around its centre to ``min(min_side, limit)`` pixels, kept inside ``[0, limit)``."""
    want = min(min_side, limit)
    if end - start >= want:
        return start, end
    centre = (start + end) / 2
    start = math.floor(centre - want / 2 + _EPS)
    start = max(0, min(start, limit - want))
    return start, start + want


def to_source_box(
    box: Any,
    *,
    space: str,
    model_size: Sequence[float] | None,
    source_size: Sequence[float],
    min_side: int = 1,
) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)`` whole pixels of the source image (end exclusive) for the box the model wrote.

    ``space``: ``"relative1000"`` or ``"absolute"`` (see the module docstring); ``model_size``: ``(width, height)``
    the model saw (needed for ``"absolute"`` only); ``source_size``: ``(width, height)`` of the original image;
    ``min_side``: the least side in source pixels (smaller boxes grow around their centre). Raises BoxError for a
    box naming no region (not 4 finite numbers, empty after clamping)."""
    if space not in BOX_SPACES:
        raise ValueError(f"unknown box space {space!r}; valid: {', '.join(BOX_SPACES)}")
    if not isinstance(min_side, int) or isinstance(min_side, bool) or min_side < 1:
        raise ValueError(f"min_side must be a positive int, got {min_side!r}")
    src_w, src_h = _size(source_size, "source_size")
    x0, y0, x1, y1 = _numbers(box)
    if space == "relative1000":
        scale_x, scale_y = src_w / 1000.0, src_h / 1000.0
    else:
        if model_size is None:
            raise ValueError("box space 'absolute' needs the model's image size (ToolContext.model_image_sizes)")
        model_w, model_h = _size(model_size, "model_size")
        scale_x, scale_y = src_w / model_w, src_h / model_h
    x0, x1 = sorted((x0 * scale_x, x1 * scale_x))
    y0, y1 = sorted((y0 * scale_y, y1 * scale_y))
    x0, x1 = min(max(x0, 0.0), src_w), min(max(x1, 0.0), src_w)
    y0, y1 = min(max(y0, 0.0), src_h), min(max(y1, 0.0), src_h)
    if x1 - x0 <= 0 or y1 - y0 <= 0:
        raise BoxError(f"the box {list(box)!r} covers no part of the image (zero width or height once clamped to "
                       f"the image); give [x0, y0, x1, y1] with x0 < x1 and y0 < y1 inside the image")
    width, height = int(round(src_w)), int(round(src_h))
    left, top = min(math.floor(x0 + _EPS), width - 1), min(math.floor(y0 + _EPS), height - 1)
    right, bottom = min(math.ceil(x1 - _EPS), width), min(math.ceil(y1 - _EPS), height)
    right, bottom = max(right, left + 1), max(bottom, top + 1)
    left, right = _grow(left, right, min_side, width)
    top, bottom = _grow(top, bottom, min_side, height)
    return left, top, right, bottom
