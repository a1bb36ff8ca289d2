"""Built-in tools: zoom / crop / rotate an image of the trajectory, and a safe calculator.

Which image ``image_index`` names: ``ToolContext.images`` lists the prompt's images first, then every image a tool
returned so far in the trajectory, in order (the rollout appends to it and keeps ``model_image_sizes`` parallel).
Crops are cut from those images at full resolution, never from the resized copy the model saw; boxes are mapped
with :func:`mmrlhf.agents.boxes.to_source_box` in the context's ``box_space``.

Every returned image is RGB (the processor converts to RGB anyway; an RGB source keeps its exact pixels).
The calculator's evaluator (an ``ast`` walk, never ``eval``) is :mod:`mmrlhf.agents.calculator`. All four are
registered by name in :mod:`mmrlhf.agents.tools`.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from mmrlhf.agents.boxes import BoxError, to_source_box
from mmrlhf.agents.calculator import CONSTANTS, FUNCTIONS, MAX_LENGTH, CalculatorError, evaluate, format_number
from mmrlhf.agents.tool_base import Tool
from mmrlhf.agents.types import ToolContext, ToolResult

_IMAGE_INDEX = {
    "type": "integer",
    "minimum": 0,
    "default": 0,
    "description": "Which image: 0 is the first image of the question; images returned by tools follow, in order.",
}
_GREY = (128, 128, 128)


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _pick_image(arguments: dict[str, Any], context: ToolContext) -> tuple[int, Any] | ToolResult:
    """``(index, image)`` named by ``image_index`` (default 0), or the bad_arguments answer for a wrong index."""
    index = int(arguments.get("image_index", 0))
    count = len(context.images)
    if not 0 <= index < count:
        have = f"0 to {count - 1}" if count else "none: this conversation has no image"
        return ToolResult(error="bad_arguments", text=f"Error: image_index {index} does not exist (valid: {have}).")
    return index, context.images[index]


def _rgb(image: Any) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise TypeError(f"context image is a {type(image).__name__}, not a PIL image")
    return image if image.mode == "RGB" else image.convert("RGB")


def _fmt_box(box: Any) -> str:
    return "[" + ", ".join(str(int(v)) if float(v).is_integer() else f"{float(v):g}" for v in box) + "]"


class _RegionTool(Tool):
    """Cuts the region a box names out of an image. ``min_box_side``: boxes smaller than this many source pixels
    grow around their centre (a 3-pixel crop shows nothing); ``blank``: answer a uniform grey image of exactly the
    size the real answer would have (an experiment's control: same tokens, no information); ``max_aspect_ratio``:
    refuse crops more elongated than this (vision processors refuse extreme ratios, e.g. 200 for Qwen-VL's)."""

    verb = "Cropped"

    def __init__(self, *, min_box_side: int = 28, blank: bool = False, max_aspect_ratio: float = 200.0) -> None:
        self.min_box_side = _positive_int(min_box_side, "min_box_side")
        if not isinstance(blank, bool):
            raise ValueError(f"blank must be true or false, got {blank!r}")
        self.blank = blank
        if not isinstance(max_aspect_ratio, (int, float)) or not max_aspect_ratio >= 1:
            raise ValueError(f"max_aspect_ratio must be a number >= 1, got {max_aspect_ratio!r}")
        self.max_aspect_ratio = float(max_aspect_ratio)

    def _shown(self, crop: Image.Image) -> Image.Image:
        """The image handed back for ``crop`` (the zoom scales it up; the crop as it is)."""
        return crop

    def __call__(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        picked = _pick_image(arguments, context)
        if isinstance(picked, ToolResult):
            return picked
        index, image = picked
        image = _rgb(image)
        model_size = context.model_image_sizes[index] if index < len(context.model_image_sizes) else None
        try:
            region = to_source_box(arguments["bbox_2d"], space=context.box_space, model_size=model_size,
                                   source_size=image.size, min_side=self.min_box_side)
        except BoxError as exc:
            return ToolResult(error="bad_arguments", text=f"Error: {exc}.")
        width, height = region[2] - region[0], region[3] - region[1]
        if max(width, height) / min(width, height) > self.max_aspect_ratio:
            return ToolResult(error="bad_arguments", text=f"Error: the region is {width}x{height} pixels, more "
                              f"elongated than {self.max_aspect_ratio:g}:1; choose a less narrow box.")
        shown = self._shown(image.crop(region))
        if self.blank:
            shown = Image.new("RGB", shown.size, _GREY)
        label = arguments.get("label")
        about = f" ({label})" if label else ""
        return ToolResult(
            text=f"{self.verb} image {index} at {_fmt_box(arguments['bbox_2d'])}{about}: a {width}x{height} "
                 f"region of the original image, shown at {shown.width}x{shown.height}.",
            images=[shown],
        )


_BOX_PARAMETERS = {
    "type": "object",
    "properties": {
        "bbox_2d": {
            "type": "array",
            "items": {"type": "number"},
            "minItems": 4,
            "maxItems": 4,
            "description": "The region as [x0, y0, x1, y1], in the coordinates you use to ground objects.",
        },
        "image_index": _IMAGE_INDEX,
        "label": {"type": "string", "description": "Optional: what you expect to find in the region."},
    },
    "required": ["bbox_2d"],
    "additionalProperties": False,
}


class ImageZoom(_RegionTool):
    """``image_zoom``: crop a region of an image at full resolution and scale it up so its shorter side is at least
    ``min_side`` pixels (aspect kept, bicubic)."""

    name = "image_zoom"
    description = ("Zoom in on a region of an image to see its details: returns the region cut from the "
                   "full-resolution image, enlarged.")
    parameters = _BOX_PARAMETERS
    verb = "Zoomed in on"

    def __init__(self, *, min_side: int = 28, min_box_side: int = 28, blank: bool = False,
                 max_aspect_ratio: float = 200.0) -> None:
        super().__init__(min_box_side=min_box_side, blank=blank, max_aspect_ratio=max_aspect_ratio)
        self.min_side = _positive_int(min_side, "min_side")

    def _shown(self, crop: Image.Image) -> Image.Image:
        short = min(crop.size)
        if short >= self.min_side:
            return crop
        factor = self.min_side / short
        size = tuple(max(self.min_side, math.ceil(side * factor - 1e-9)) for side in crop.size)
        return crop.resize(size, Image.Resampling.BICUBIC)


class ImageCrop(_RegionTool):
    """``image_crop``: the region of an image at full resolution, at its own size (no scaling)."""

    name = "image_crop"
    description = "Cut a region out of an image: returns the region of the full-resolution image at its own size."
    parameters = _BOX_PARAMETERS


class ImageRotate(Tool):
    """``image_rotate``: an image turned counter-clockwise by 90, 180 or 270 degrees (lossless)."""

    name = "image_rotate"
    description = "Rotate an image counter-clockwise by 90, 180 or 270 degrees (e.g. to read sideways text)."
    parameters = {
        "type": "object",
        "properties": {
            "angle": {"type": "integer", "enum": [90, 180, 270], "description": "Degrees, counter-clockwise."},
            "image_index": _IMAGE_INDEX,
        },
        "required": ["angle"],
        "additionalProperties": False,
    }
    _TURNS = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}

    def __call__(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        picked = _pick_image(arguments, context)
        if isinstance(picked, ToolResult):
            return picked
        index, image = picked
        angle = int(arguments["angle"])
        rotated = _rgb(image).transpose(self._TURNS[angle])
        return ToolResult(text=f"Rotated image {index} by {angle} degrees counter-clockwise.", images=[rotated])


class Calculator(Tool):
    """``calculator``: an arithmetic expression's value (see :mod:`mmrlhf.agents.calculator` for what is
    allowed); a refused or failing expression is a ``bad_arguments`` answer saying why."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses, the functions "
                   f"{', '.join(FUNCTIONS)} and the constants {', '.join(CONSTANTS)}.")
    parameters = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "maxLength": MAX_LENGTH, "description": "e.g. \"sqrt(2) * (3 + 4)\""},
        },
        "required": ["expression"],
        "additionalProperties": False,
    }

    def __call__(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        expression = arguments["expression"]
        try:
            value = evaluate(expression)
        except CalculatorError as exc:
            return ToolResult(error="bad_arguments", text=f"Error: {exc}.")
        return ToolResult(text=f"{expression.strip()} = {format_number(value)}")
