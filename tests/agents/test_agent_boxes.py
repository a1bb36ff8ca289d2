"""Boxes the model writes -> source pixels, in both coordinate spaces (relative 0-1000 and absolute resized)."""

from __future__ import annotations

import math

import pytest

from mmrlhf.agents.boxes import BoxError, to_source_box

SOURCE = (2000, 1000)
MODEL = (1008, 504)  # what a Qwen2.5-VL processor might resize the 2000x1000 source to


def test_worked_examples_of_the_docstring():
    assert to_source_box([250, 100, 500, 600], space="relative1000", model_size=None, source_size=SOURCE) == (
        500, 100, 1000, 600)
    assert to_source_box([252, 50, 504, 302], space="absolute", model_size=MODEL, source_size=SOURCE) == (
        500, 99, 1000, 600)


def test_relative_and_absolute_boxes_of_one_region_agree():
    relative = to_source_box([250, 100, 500, 600], space="relative1000", model_size=None, source_size=SOURCE)
    absolute = to_source_box([252, 50.4, 504, 302.4], space="absolute", model_size=MODEL, source_size=SOURCE)
    assert relative == absolute == (500, 100, 1000, 600)
    # control: the absolute box read as relative (the peers' bug) names another region
    wrong = to_source_box([252, 50.4, 504, 302.4], space="relative1000", model_size=None, source_size=SOURCE)
    assert wrong != absolute


def test_corners_are_ordered_and_clamped():
    box = to_source_box([500, 600, 250, 100], space="relative1000", model_size=None, source_size=SOURCE)
    assert box == (500, 100, 1000, 600)
    assert to_source_box([-100, -50, 1200, 500], space="relative1000", model_size=None,
                         source_size=(400, 200)) == (0, 0, 400, 100)
    assert to_source_box([900, 400, 5000, 9000], space="absolute", model_size=MODEL, source_size=SOURCE) == (
        1785, 793, 2000, 1000)  # floor(1785.7), floor(793.7): every touched pixel


@pytest.mark.parametrize("box", [[100, 100, 100, 200], [100, 300, 400, 300], [1100, 0, 1200, 100],
                                 [-50, -50, -1, 500]])
def test_empty_boxes_are_refused(box):
    with pytest.raises(BoxError, match="covers no part of the image"):
        to_source_box(box, space="relative1000", model_size=None, source_size=SOURCE)


@pytest.mark.parametrize("box", [[1, 2, 3], [1, 2, 3, 4, 5], "1234", None, [1, 2, 3, True], [1, 2, "3", 4],
                                 [0, 0, math.nan, 10], [0, 0, math.inf, 10], {"x0": 1}])
def test_boxes_that_are_not_four_finite_numbers_are_refused(box):
    with pytest.raises(BoxError, match="box"):
        to_source_box(box, space="relative1000", model_size=None, source_size=SOURCE)


def test_tiny_boxes_grow_around_their_centre_and_stay_inside():
    # a 2x2-pixel box in the middle grows to 28x28 centred on it
    box = to_source_box([500, 500, 501, 502], space="relative1000", model_size=None, source_size=SOURCE,
                        min_side=28)
    assert box[2] - box[0] == 28 and box[3] - box[1] == 28
    assert abs((box[0] + box[2]) / 2 - 1001) <= 1 and abs((box[1] + box[3]) / 2 - 501) <= 1
    # at the corner it is shifted inside the image
    assert to_source_box([0, 0, 1, 1], space="relative1000", model_size=None, source_size=SOURCE,
                         min_side=28) == (0, 0, 28, 28)
    assert to_source_box([999, 999, 1000, 1000], space="relative1000", model_size=None, source_size=SOURCE,
                         min_side=28) == (1972, 972, 2000, 1000)
    # an image narrower than min_side: the whole side
    assert to_source_box([100, 100, 200, 200], space="relative1000", model_size=None, source_size=(10, 500),
                         min_side=28)[::2] == (0, 10)
    # boxes big enough are left alone (control)
    assert to_source_box([250, 100, 500, 600], space="relative1000", model_size=None, source_size=SOURCE,
                         min_side=28) == (500, 100, 1000, 600)


def test_caller_mistakes_are_plain_value_errors_not_box_errors():
    with pytest.raises(ValueError, match="unknown box space") as info:
        to_source_box([0, 0, 10, 10], space="pixels", model_size=None, source_size=SOURCE)
    assert not isinstance(info.value, BoxError)
    with pytest.raises(ValueError, match="needs the model's image size") as info:
        to_source_box([0, 0, 10, 10], space="absolute", model_size=None, source_size=SOURCE)
    assert not isinstance(info.value, BoxError)
    with pytest.raises(ValueError, match="min_side"):
        to_source_box([0, 0, 10, 10], space="relative1000", model_size=None, source_size=SOURCE, min_side=0)
