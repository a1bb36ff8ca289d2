"""The built-in image tools on real PIL images: exact pixels of the source region, both box spaces, clamping,
growing, errors answered as bad_arguments, the blank control, rotation."""

from __future__ import annotations

import re

import numpy as np
import pytest
from image_testing import pattern
from PIL import Image

from mmrlhf.agents.builtin_tools import ImageCrop, ImageRotate, ImageZoom
from mmrlhf.agents.tool_base import validate_arguments
from mmrlhf.agents.types import ToolContext


def context(*images, sizes=None, space="relative1000") -> ToolContext:
    return ToolContext(record={}, images=list(images), model_image_sizes=list(sizes or []), box_space=space)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)  # (H, W, 3)


def test_zoom_returns_the_exact_source_region_when_big_enough(image_2000x1000):
    result = ImageZoom()({"bbox_2d": [250, 100, 500, 600]}, context(image_2000x1000))
    assert result.error is None and len(result.images) == 1
    assert np.array_equal(pixels(result.images[0]), pixels(image_2000x1000)[100:600, 500:1000])
    assert "image 0" in result.text and "500x500" in result.text


def test_relative_and_absolute_boxes_crop_the_same_pixels(image_2000x1000):
    rel = ImageCrop()({"bbox_2d": [250, 100, 500, 600]}, context(image_2000x1000))
    abs_ = ImageCrop()({"bbox_2d": [252, 50.4, 504, 302.4]},
                       context(image_2000x1000, sizes=[(1008, 504)], space="absolute"))
    assert np.array_equal(pixels(rel.images[0]), pixels(abs_.images[0]))
    # control: the same numbers in the other space cut another region
    other = ImageCrop()({"bbox_2d": [252, 50.4, 504, 302.4]}, context(image_2000x1000))
    assert pixels(other.images[0]).shape != pixels(abs_.images[0]).shape


def test_small_zoom_is_scaled_up_keeping_aspect_and_crop_is_not(image_2000x1000):
    box = {"bbox_2d": [100, 100, 105, 120]}  # 10 x 20 source pixels
    crop = ImageCrop(min_box_side=1)(box, context(image_2000x1000))
    assert crop.images[0].size == (10, 20)
    assert np.array_equal(pixels(crop.images[0]), pixels(image_2000x1000)[100:120, 200:210])
    zoom = ImageZoom(min_box_side=1, min_side=28)(box, context(image_2000x1000))
    assert zoom.images[0].size == (28, 56)
    assert "shown at 28x56" in zoom.text


def test_tiny_box_grows_to_min_box_side(image_2000x1000):
    result = ImageCrop(min_box_side=28)({"bbox_2d": [500, 500, 500.5, 501]}, context(image_2000x1000))
    assert result.images[0].size == (28, 28)


def test_clamped_box_crops_inside_the_image(image_2000x1000):
    result = ImageCrop()({"bbox_2d": [900, 900, 1500, 1500]}, context(image_2000x1000))
    assert np.array_equal(pixels(result.images[0]), pixels(image_2000x1000)[900:1000, 1800:2000])


def test_second_image_uses_its_own_model_size():
    first, second = pattern(100, 100), pattern(400, 200)
    ctx = context(first, second, sizes=[(56, 56), (200, 100)], space="absolute")
    result = ImageCrop(min_box_side=1)({"bbox_2d": [50, 25, 100, 75], "image_index": 1}, ctx)
    assert np.array_equal(pixels(result.images[0]), pixels(second)[50:150, 100:200])


@pytest.mark.parametrize("arguments, match", [
    ({"bbox_2d": [10, 10, 10, 50]}, "covers no part"),
    ({"bbox_2d": [1100, 0, 1200, 100]}, "covers no part"),
    ({"bbox_2d": [0, 0, 100, 100], "image_index": 3}, "image_index 3 does not exist .valid: 0 to 0"),
])
def test_bad_boxes_and_indexes_are_bad_arguments_answers(image_2000x1000, arguments, match):
    result = ImageZoom()(arguments, context(image_2000x1000))
    assert result.error == "bad_arguments" and not result.images
    assert result.text.startswith("Error:")
    assert re.search(match, result.text)


def test_box_schema_refuses_malformed_arguments_before_the_tool_runs():
    tool = ImageZoom()
    assert validate_arguments(tool, {"bbox_2d": [0, 0, 10, 10], "image_index": 1, "label": "cat"}) is None
    assert "bbox_2d" in validate_arguments(tool, {"bbox_2d": [0, 0, 10]})
    assert "image_index" in validate_arguments(tool, {"bbox_2d": [0, 0, 10, 10], "image_index": -1})
    assert "required" in validate_arguments(tool, {"image_index": 0})
    assert "zoom" in validate_arguments(tool, {"bbox_2d": [0, 0, 10, 10], "zoom": 2})


def test_blank_option_answers_a_uniform_grey_image_of_the_same_size(image_2000x1000):
    box = {"bbox_2d": [100, 100, 105, 120]}
    real = ImageZoom(min_box_side=1)(box, context(image_2000x1000))
    blank = ImageZoom(min_box_side=1, blank=True)(box, context(image_2000x1000))
    assert blank.images[0].size == real.images[0].size
    values = pixels(blank.images[0])
    assert (values == values[0, 0]).all()
    assert len(np.unique(pixels(real.images[0]).reshape(-1, 3), axis=0)) > 1  # control: the real crop is not


def test_elongated_regions_are_refused():
    result = ImageCrop(min_box_side=1, max_aspect_ratio=50)({"bbox_2d": [0, 0, 1000, 1]}, context(pattern(2000, 10)))
    assert result.error == "bad_arguments" and "elongated" in result.text


def test_non_rgb_sources_come_back_rgb():
    grey = Image.fromarray(np.arange(100 * 50, dtype=np.uint32).reshape(50, 100).astype(np.uint8), "L")
    result = ImageCrop(min_box_side=1)({"bbox_2d": [0, 0, 500, 1000]}, context(grey))
    assert result.images[0].mode == "RGB"
    assert np.array_equal(pixels(result.images[0])[..., 0], np.asarray(grey)[:, :50])


@pytest.mark.parametrize("angle, k", [(90, 1), (180, 2), (270, 3)])
def test_rotate_is_lossless_counter_clockwise(angle, k):
    source = pattern(30, 20)
    result = ImageRotate()({"angle": angle}, context(source))
    assert np.array_equal(pixels(result.images[0]), np.rot90(pixels(source), k=k))  # rot90: counter-clockwise
    assert f"{angle} degrees" in result.text


def test_rotate_refuses_other_angles_and_missing_images():
    assert "angle" in validate_arguments(ImageRotate(), {"angle": 45})
    result = ImageRotate()({"angle": 90}, context())
    assert result.error == "bad_arguments" and "no image" in result.text


def test_options_are_checked():
    with pytest.raises(ValueError, match="min_side"):
        ImageZoom(min_side=0)
    with pytest.raises(ValueError, match="blank"):
        ImageCrop(blank="yes")
