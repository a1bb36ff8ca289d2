"""Data preparation: synthetic rows shaped like the public releases convert into records the project's own loader
reads back with the expected prompts, images / videos, labels and answers; malformed rows fail naming the row and
field (or are skipped and counted when asked)."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmrlhf.config.data import DataConfig
from mmrlhf.data.datasets import PromptDataset
from mmrlhf.data.errors import DataError
from mmrlhf.data.prepare import prepare
from mmrlhf.data.prepare.__main__ import main as prepare_main
from mmrlhf.data.vision import VisionLoader, VisionSettings
from mmrlhf.testing import published_data


def _load(path):
    return list(PromptDataset(str(path), DataConfig()))


def _pixels(item, base_dir):
    """The decoded image the training loader would see (no resizing: factor 1, no bounds)."""
    loader = VisionLoader(VisionSettings(resize_factor=1, temporal_factor=1))
    return np.asarray(loader.load_image(item, base_dir))


def _raw_pixels(data: bytes):
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("images", ["files", "inline"])
def test_geometry3k_parquet_round_trips_prompts_images_and_answers(tmp_path, images):
    src, rows = published_data.geometry3k(tmp_path / "raw")
    summary = prepare("geometry3k", [str(src)], str(tmp_path / "out" / "train.jsonl"), images=images)
    assert summary.written == len(rows) and summary.skips.total == 0
    records = _load(tmp_path / "out" / "train.jsonl")
    assert [r.prompt for r in records] == [row["problem"] for row in rows]  # the published <image> marker is kept
    assert [r.reference for r in records] == [row["answer"] for row in rows]
    assert {r.label for r in records} == {"math"}
    for record, row in zip(records, rows):
        assert len(record.images) == 1
        if images == "files":
            assert record.images[0].startswith("images/")  # relative: the output folder moves as a whole
        else:
            assert record.images[0].startswith("data:image/png;base64,")
        np.testing.assert_array_equal(_pixels(record.images[0], record.base_dir),
                                      _raw_pixels(row["images"][0]["bytes"]))


def test_geometry3k_from_a_save_to_disk_folder_with_image_features(tmp_path):
    """The same release loaded with `datasets` and saved (Image features, decoded on access) converts alike."""
    datasets = pytest.importorskip("datasets")
    _, rows = published_data.geometry3k(tmp_path / "raw", n=2)
    features = datasets.Features({"images": datasets.List(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    prepare("geometry3k", [str(tmp_path / "saved")], str(tmp_path / "out" / "train.jsonl"))
    records = _load(tmp_path / "out" / "train.jsonl")
    assert [r.reference for r in records] == [row["answer"] for row in rows]
    np.testing.assert_array_equal(_pixels(records[1].images[0], records[1].base_dir),
                                  _raw_pixels(rows[1]["images"][0]["bytes"]))


def test_clevr_count_json_with_image_paths_and_wrapped_answers(tmp_path):
    src, rows = published_data.clevr_count(tmp_path / "raw")
    out = tmp_path / "out" / "clevr.jsonl"
    prepare("clevr_count", [str(src)], str(out), media_root=str(tmp_path / "raw" / "images"))
    records = _load(out)
    assert [r.reference for r in records] == [str(k + 2) for k in range(len(rows))]  # "<answer> 2 </answer>" -> "2"
    assert all(r.prompt == "<image>How many items are there in the image?" and r.label == "count" for r in records)
    assert records[1].images == [str(tmp_path / "raw" / "images" / rows[1]["image"])]


def test_multi_image_numbered_columns_options_and_letter_answers(tmp_path):
    src, rows = published_data.multi_image(tmp_path / "raw")
    out = tmp_path / "out" / "mi.jsonl"
    prepare("multi_image", [str(src)], str(out))
    records = _load(out)
    assert [len(r.images) for r in records] == [3, 2, 3, 2]  # empty image_3 columns are dropped
    assert [r.reference for r in records] == ["B", "A", "B", "A"]
    assert records[0].prompt == "<image><image><image>Which image is brighter?\nOptions:\nA. the first\nB. the second"
    assert [r.record_id for r in records] == [row["idx"] for row in rows]
    for j, item in enumerate(records[2].images):  # images keep their column order
        expected = _raw_pixels(rows[2][f"image_{j + 1}"]["bytes"])
        np.testing.assert_array_equal(_pixels(item, records[2].base_dir), expected)


def test_video_qa_json_answer_text_becomes_the_option_letter_and_the_video_loads(tmp_path):
    src, rows = published_data.video_qa(tmp_path / "raw")
    out = tmp_path / "out" / "video.jsonl"
    prepare("video_qa", [str(src)], str(out), media_root=str(tmp_path / "raw" / "videos"))
    records = _load(out)
    assert [r.reference for r in records] == ["A", "B", "C"]
    assert records[0].prompt.startswith("<video>What happens in the video?\nOptions:\nA. a ball rolls\n")
    assert [r.record_id for r in records] == ["v0", "v1", "v2"] and {r.label for r in records} == {"mcq"}
    loader = VisionLoader(VisionSettings(resize_factor=28, temporal_factor=2, video_fps=100.0, video_max_frames=64))
    video = loader.load_video(records[2].videos[0], records[2].base_dir)
    assert video.frames.shape[0] == 10  # every frame of the 10-frame clip (fps above the clip's)


def test_open_vqa_keeps_every_reference_and_gives_a_caption_row_its_instruction(tmp_path):
    src, rows = published_data.open_vqa(tmp_path / "raw")
    out = tmp_path / "out" / "open.jsonl"
    prepare("open_vqa", [str(src)], str(out))
    records = _load(out)
    assert [r.reference for r in records] == [row["answer"] for row in rows[:-1]] + [rows[-1]["answer"][0]]
    assert records[0].prompt == "<image>" + rows[0]["question"]
    assert records[1].prompt == "<image>Describe the image in one sentence."  # no question: the caption one
    assert {r.label for r in records} == {"open"} and [r.record_id for r in records] == [
        row["question_id"] for row in rows]
    np.testing.assert_array_equal(_pixels(records[2].images[0], records[2].base_dir),
                                  _raw_pixels(rows[2]["image"]["bytes"]))
    bad = _parquet(tmp_path / "bad.parquet", [{"image": rows[0]["image"], "answer": ["fine", ""]}])
    with pytest.raises(DataError, match="field .answer / answers.*non-empty texts"):
        prepare("open_vqa", [bad], str(tmp_path / "bad.jsonl"))


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_bad_rows_raise_naming_record_field_and_file(tmp_path):
    good = published_data.png_bytes(0)
    src = _parquet(tmp_path / "g.parquet", [
        {"images": [{"bytes": good, "path": None}], "problem": "<image>ok", "answer": "1"},
        {"images": [{"bytes": b"not an image", "path": None}], "problem": "<image>bad", "answer": "2"},
    ])
    with pytest.raises(DataError) as err:
        prepare("geometry3k", [src], str(tmp_path / "o.jsonl"))
    assert "record 1" in str(err.value) and "field 'images'" in str(err.value) and "g.parquet" in str(err.value)
    assert "do not decode" in str(err.value)
    assert not (tmp_path / "o.jsonl").exists()  # nothing half-written

    (tmp_path / "c.json").write_text(json.dumps([{"image": "missing.png", "problem": "How many?", "solution": "3"}]))
    with pytest.raises(DataError, match=r"record 0, field 'image'.*missing\.png.*not found"):
        prepare("clevr_count", [str(tmp_path / "c.json")], str(tmp_path / "c.jsonl"))

    (tmp_path / "img.png").write_bytes(good)
    (tmp_path / "n.json").write_text(json.dumps([{"image": "img.png", "problem": "How many?", "solution": "many"}]))
    with pytest.raises(DataError,
                       match=r"record 0, field 'solution / answer'.*whole-number count in ASCII digits, got 'many'"):
        prepare("clevr_count", [str(tmp_path / "n.json")], str(tmp_path / "n.jsonl"))

    video = published_data.write_video(tmp_path / "v.mp4")
    (tmp_path / "v.jsonl").write_text(json.dumps({"id": "q9", "video": video.name, "options": ["x", "y"],
                                                  "answer": "z"}) + "\n")
    with pytest.raises(DataError, match=r"record 0 \(id='q9'\), field 'question / problem'.*missing or empty"):
        prepare("video_qa", [str(tmp_path / "v.jsonl")], str(tmp_path / "vo.jsonl"))


def test_duplicate_ids_are_an_error(tmp_path):
    img = {"bytes": published_data.png_bytes(2), "path": None}
    src = _parquet(tmp_path / "d.parquet", [{"id": "a", "images": [img], "problem": "Find x.", "answer": "1"},
                                            {"id": "a", "images": [img], "problem": "Find y.", "answer": "2"}])
    with pytest.raises(DataError, match=r"record 1 \(id='a'\), field 'id'.*duplicate id 'a'"):
        prepare("geometry3k", [src], str(tmp_path / "d.jsonl"))


def test_an_answer_outside_the_options_is_an_error(tmp_path):
    img = {"bytes": published_data.png_bytes(1), "path": None}
    src = _parquet(tmp_path / "m.parquet", [{"image_1": img, "image_2": img, "question": "Same?",
                                             "choices": ["yes", "no"], "answer": "maybe"}])
    with pytest.raises(DataError, match=r"record 0, field 'answer'.*'maybe' is neither an option letter \(A, B\)"):
        prepare("multi_image", [src], str(tmp_path / "m.jsonl"))


def test_skip_mode_counts_and_logs_bad_rows(tmp_path, caplog):
    src, _ = published_data.clevr_count(tmp_path / "raw", n=3)
    rows = json.loads(src.read_text())
    rows[1]["image"] = "gone.png"
    src.write_text(json.dumps(rows))
    summary = prepare("clevr_count", [str(src)], str(tmp_path / "o.jsonl"), on_bad_record="skip",
                      media_root=str(tmp_path / "raw" / "images"))
    assert summary.written == 2 and summary.skips.counts == {"bad_record": 1}
    # answers in other digits ("²" made int() crash; "٣" is no ASCII answer) are bad rows, named and skippable
    for bad in ("²", "٣"):
        rows = json.loads(src.read_text())
        rows[1]["image"], rows[2]["solution"] = rows[0]["image"], f"<answer>{bad}</answer>"
        src.write_text(json.dumps(rows))
        with pytest.raises(DataError, match=r"record 2, field 'solution / answer'.*ASCII digits"):
            prepare("clevr_count", [str(src)], str(tmp_path / "e.jsonl"), media_root=str(tmp_path / "raw" / "images"))
        summary = prepare("clevr_count", [str(src)], str(tmp_path / "o2.jsonl"), on_bad_record="skip",
                          media_root=str(tmp_path / "raw" / "images"))
        assert summary.written == 2 and summary.skips.counts == {"bad_record": 1}
    assert "record 1" in caplog.text and "gone.png" in caplog.text
    assert [r.record_id for r in _load(tmp_path / "o.jsonl")] == ["clevr-0", "clevr-2"]


def test_cli_prints_a_summary_and_reports_errors(tmp_path, capsys):
    src, rows = published_data.geometry3k(tmp_path / "raw", n=2)
    out = tmp_path / "g.jsonl"
    assert prepare_main(["geometry3k", str(src), "-o", str(out), "--limit", "1"]) == 0
    assert f"wrote 1 records to {out}" in capsys.readouterr().out
    assert len(_load(out)) == 1
    assert prepare_main(["multi_image", str(src), "-o", str(tmp_path / "m.jsonl")]) == 2
    assert "error: record 0, field 'images / image_<n>'" in capsys.readouterr().err


def test_deepeyes_drops_the_tool_prompt_labels_by_source_and_keeps_the_images(tmp_path):
    src, rows = published_data.deepeyes(tmp_path / "raw")
    summary = prepare("deepeyes", [str(src)], str(tmp_path / "out" / "train.jsonl"))
    assert summary.written == len(rows) and summary.skips.total == 0
    records = _load(tmp_path / "out" / "train.jsonl")
    # the question as the user asked it: DeepEyes' system message (its tool schema) and format instruction are gone
    assert [r.prompt for r in records] == [f"<image>\n{row['extra_info']['question']}" for row in rows]
    assert not any("image_zoom_in_tool" in r.prompt or "Think first" in r.prompt for r in records)
    assert [r.label for r in records] == ["deepeyes", "math", "deepeyes"] * 2
    assert [r.reference for r in records] == [row["reward_model"]["ground_truth"] for row in rows]
    assert [r.record_id for r in records] == [f"deepeyes-{k}" for k in range(len(rows))]
    for record, row in zip(records, rows):
        np.testing.assert_array_equal(_pixels(record.images[0], record.base_dir),
                                      _raw_pixels(row["images"][0]["bytes"]))


def test_deepeyes_reads_content_parts_and_falls_back_to_extra_info_answer(tmp_path):
    _, rows = published_data.deepeyes(tmp_path / "raw", n=1)
    row = rows[0]
    row["prompt"] = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    row["reward_model"] = {"ground_truth": None, "style": "model"}
    src = _parquet(tmp_path / "parts.parquet", [row])
    prepare("deepeyes", [src], str(tmp_path / "parts.jsonl"))
    (record,) = _load(tmp_path / "parts.jsonl")
    assert (record.prompt, record.reference, record.label) == ("<image>Which colour?", "B", "deepeyes")


@pytest.mark.parametrize("change, field, message", [
    (lambda r: r.update(images=[{"bytes": b"not an image", "path": None}]), "images", "do not decode"),
    (lambda r: r.update(images=[]), "images", "no image"),
    (lambda r: r.update(data_source="geoguessr"), "data_source", "unknown data source 'geoguessr'"),
    (lambda r: r["prompt"][1].update(content="<image>\nZoom with image_zoom_in_tool, then say."), "prompt",
     "still names DeepEyes' tool"),
    (lambda r: r.update(reward_model={"ground_truth": "", "style": "model"}, extra_info={"answer": None}),
     "reward_model.ground_truth", "no reference"),
])
def test_deepeyes_bad_rows_raise_naming_the_field_or_are_skipped_and_counted(tmp_path, change, field, message):
    _, rows = published_data.deepeyes(tmp_path / "raw", n=3)
    change(rows[1])
    src = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=rf"record 1, field '{re.escape(field)}'.*{message}"):
        prepare("deepeyes", [src], str(tmp_path / "bad.jsonl"))
    assert not (tmp_path / "bad.jsonl").exists()
    summary = prepare("deepeyes", [src], str(tmp_path / "kept.jsonl"), on_bad_record="skip")
    assert summary.written == 2 and summary.skips.counts == {"bad_record": 1}
    assert [r.record_id for r in _load(tmp_path / "kept.jsonl")] == ["deepeyes-0", "deepeyes-2"]
