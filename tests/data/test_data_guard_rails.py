"""Every bad vision input: error mode names record and file; skip mode drops it, counts it and keeps order."""

from __future__ import annotations

import logging

import pytest
from data_testing import solid_image

from mmrlhf.config.data import DataConfig
from mmrlhf.data import DataError, PromptRecord

BAD = [
    # (case, field, reason, file name in the message)
    ("missing_image", "images", "missing_file", "nope.png"),
    ("corrupt_image", "images", "corrupt_image", "broken.png"),
    ("huge_image", "images", "image_too_large", "huge.png"),
    ("missing_video", "videos", "missing_file", "nope.mp4"),
    ("corrupt_video", "videos", "corrupt_video", "broken.mp4"),
    ("empty_video", "videos", "empty_video", "empty.mp4"),
]


def _records(media, case):
    huge = f"{media['dir']}/huge.png"
    solid_image((120, 120)).save(huge)
    bad_item = {"missing_image": f"{media['dir']}/nope.png", "corrupt_image": media["broken_png"],
                "huge_image": huge, "missing_video": f"{media['dir']}/nope.mp4",
                "corrupt_video": media["broken_mp4"], "empty_video": media["empty_mp4"]}[case]
    is_video = "video" in case
    bad = PromptRecord(index=1, record_id="bad", prompt="<video>x" if is_video else "<image>x",
                       images=[] if is_video else [bad_item], videos=[bad_item] if is_video else [],
                       reference="r1")
    good = [PromptRecord(index=0, record_id="a", prompt="<image>a", images=[media["img0"]], reference="r0"),
            PromptRecord(index=2, record_id="c", prompt="<video>c", videos=[media["video"]], reference="r2")]
    return [good[0], bad, good[1]]


@pytest.mark.parametrize("case,field,reason,name", BAD)
def test_error_mode_names_record_and_file(make_processor, media, case, field, reason, name):
    proc = make_processor(image_pixel_limit=100 * 100)
    with pytest.raises(DataError) as info:
        proc.process_records(_records(media, case), 2)
    err = info.value
    assert (err.reason, err.index, err.record_id, err.field) == (reason, 1, "bad", field)
    assert "record 1 (id='bad')" in str(err) and name in str(err)


@pytest.mark.parametrize("case,field,reason,name", BAD)
def test_skip_mode_counts_and_logs(make_processor, media, caplog, case, field, reason, name):
    proc = make_processor(image_pixel_limit=100 * 100, on_bad_input="skip")
    with caplog.at_level(logging.WARNING, logger="mmrlhf.data"):
        out = proc.process_records(_records(media, case), 2)
    assert out.all_prompt_indices == [0, 0, 2, 2] and out.all_references == ["r0", "r0", "r2", "r2"]
    assert proc.skips.counts == {reason: 1} and proc.skips.total == 1
    assert [(s.index, s.record_id, s.reason) for s in out.skipped] == [(1, "bad", reason)]
    assert any(name in rec.getMessage() and "record 1" in rec.getMessage() for rec in caplog.records)


def test_config_rejects_inverted_bounds():
    with pytest.raises(ValueError, match="image_min_pixels .* must not exceed data.image_max_pixels"):
        DataConfig(image_min_pixels=100, image_max_pixels=10)
    with pytest.raises(ValueError, match="on_bad_input"):
        DataConfig(on_bad_input="ignore")
    with pytest.raises(ValueError, match="must differ"):
        DataConfig(image_placeholder="<x>", video_placeholder="<x>")
