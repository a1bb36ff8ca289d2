"""The toy shapes task: deterministic per (split, index), answers visible in the pixels, a blank control."""

from __future__ import annotations

import pytest

from mmrlhf.tasks.shapes import COLOURS, TASKS, first_word, first_word_reward, make_record


@pytest.mark.parametrize("task", TASKS)
def test_records_are_deterministic_and_splits_differ(task):
    a, b = make_record(3, task=task), make_record(3, task=task)
    assert a["reference"] == b["reference"] and a["images"][0].tobytes() == b["images"][0].tobytes()
    train = [make_record(i, task=task)["images"][0].tobytes() for i in range(20)]
    evals = [make_record(i, split="eval", task=task)["images"][0].tobytes() for i in range(20)]
    assert not any(e in train for e in evals)  # the eval split never repeats a training image
    assert a["prompt"].startswith("<image>") and a["label"] == task


def test_answers_are_balanced_and_visible():
    refs = [make_record(i)["reference"] for i in range(400)]
    assert {r: refs.count(r) for r in COLOURS} == pytest.approx({r: 100 for r in COLOURS}, abs=30)
    rec = make_record(0)
    r, g, b = rec["images"][0].getpixel((10, 10))
    assert max(COLOURS, key=lambda c: -sum(abs(x - y) for x, y in zip(COLOURS[c], (r, g, b)))) == rec["reference"]
    counts = [make_record(i, task="count") for i in range(40)]
    for rec in counts:
        img = rec["images"][0]
        background = img.getpixel((0, 0))  # squares never touch the border
        drawn = sum(1 for x in range(img.size[0]) for y in range(img.size[1]) if img.getpixel((x, y)) != background)
        side = max((img.size[0] // 2) * 2 // 3, 4)
        assert drawn == int(rec["reference"]) * side * side


def test_blank_control_hides_the_answer():
    recs = [make_record(i, blank=True) for i in range(10)]
    pixels = {r["images"][0].tobytes() for r in recs}
    assert len(pixels) == 1  # every image the same grey
    assert len({r["reference"] for r in recs}) > 1
    with pytest.raises(ValueError, match="unknown task"):
        make_record(0, task="size")


def test_first_word_reward():
    assert first_word("  Red, I think") == "red" and first_word("...") == ""
    assert first_word_reward(["red", "blue red", "", "3 squares"], ["p"] * 4, ["x"] * 4,
                             ["red", "red", "red", "3"]) == [1.0, 0.0, 0.0, 1.0]
    assert first_word_reward(["red"], ["p"], ["x"], [None]) == [None]
