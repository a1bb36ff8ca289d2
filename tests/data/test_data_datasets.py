"""Prompt datasets: JSONL, Parquet and datasets folders; configurable columns; per-record checks; skip counting."""

from __future__ import annotations

import io
import json

import pytest
from data_testing import solid_image

from mmrlhf.config.data import DataConfig
from mmrlhf.data import DataError, PromptDataset, read_rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(media):
    return [
        {"id": "t", "prompt": "Count to three.", "label": "math", "reference": "3"},
        {"id": "i", "prompt": "<image>What color?", "images": "img0.png", "label": "color", "reference": "red"},
        {"id": "m", "prompt": "<image> vs <image>", "images": ["img0.png", media["img1"]]},
        {"id": "v", "prompt": "<video>what?", "videos": "clip.mp4"},
    ]


def test_jsonl_records(media, tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(media))
    ds = PromptDataset(path, DataConfig())
    assert [r.record_id for r in ds] == ["t", "i", "m", "v"]
    assert [r.index for r in ds] == [0, 1, 2, 3]
    assert ds[0].images == [] and ds[0].label == "math" and ds[0].reference == "3"
    assert ds[2].images == ["img0.png", media["img1"]]
    assert ds[3].videos == ["clip.mp4"] and ds[3].label is None
    assert ds[1].base_dir == str(tmp_path)


def test_jsonl_end_to_end_resolves_relative_paths(media, tmp_path, make_processor):
    ds = PromptDataset(_write_jsonl(tmp_path / "p.jsonl", _rows(media)), DataConfig())
    out = make_processor().process_records(list(ds), 2)
    assert out.all_images_num == [0, 0, 1, 1, 2, 2, 0, 0] and out.all_videos_num == [0] * 6 + [1, 1]
    assert out.all_labels[2] == "color" and out.all_references[0] == "3"


def test_custom_columns_and_placeholders(tmp_path):
    rows = [{"question": "[IMG] what?", "pics": ["a.png"], "answer": "x", "task": "t", "uid": 7}]
    cfg = DataConfig(prompt_key="question", image_key="pics", reference_key="answer", label_key="task",
                     id_key="uid", image_placeholder="[IMG]")
    rec = PromptDataset(_write_jsonl(tmp_path / "p.jsonl", rows), cfg)[0]
    assert (rec.images, rec.reference, rec.label, rec.record_id) == (["a.png"], "x", "t", 7)


def test_extra_columns_are_kept_per_record_for_the_tools(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmrlhf.data.stream import record_columns

    rows = [{"question": "[IMG] flip?", "pics": ["front.png"], "answer": "x", "task": "t", "uid": 7,
             "back": "cards/back.png", "card": {"suit": "hearts", "rank": 3}, "prompt": "shown to tools only"},
            {"question": "plain", "uid": 8}]
    cfg = DataConfig(prompt_key="question", image_key="pics", reference_key="answer", label_key="task",
                     id_key="uid", image_placeholder="[IMG]")
    ds = PromptDataset(_write_jsonl(tmp_path / "p.jsonl", rows), cfg)
    # every column no data.*_key maps, as read (a column named like a standard field included: it is not mapped)
    assert ds[0].extras == {"back": "cards/back.png", "card": {"suit": "hearts", "rank": 3},
                            "prompt": "shown to tools only"}
    assert ds[1].extras == {}
    columns = record_columns(list(ds))
    assert columns["extras"][0] is ds[0].extras  # carried per record, not copied
    pq.write_table(pa.table({"prompt": ["a", "b"], "back": ["b1.png", None], "n": [1, 2]}), tmp_path / "p.parquet")
    assert [r.extras for r in PromptDataset(str(tmp_path / "p.parquet"), DataConfig())] == [
        {"back": "b1.png", "n": 1}, {"back": None, "n": 2}]


def test_chat_messages_with_inline_parts(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                      {"type": "text", "text": "and"},
                                                      {"type": "video", "video": "v.mp4"}]}]}]
    rec = PromptDataset(_write_jsonl(tmp_path / "p.jsonl", rows), DataConfig())[0]
    assert rec.images == ["a.png"] and rec.videos == ["v.mp4"]


def test_placeholder_mismatch_error_names_record(tmp_path):
    rows = [{"id": "ok", "prompt": "hi"}, {"id": "bad", "prompt": "<image> only one", "images": ["a", "b"]}]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=r"record 1 \(id='bad'\).*'prompt'.*p\.jsonl.*1 image place\(s\).*2 image"):
        PromptDataset(path, DataConfig())
    ds = PromptDataset(path, DataConfig(on_bad_input="skip"))
    assert len(ds) == 1 and ds.skips.counts == {"placeholder_mismatch": 1}


def test_chat_parts_count_checked(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
             "images": ["a.png", "b.png"]}]
    with pytest.raises(DataError, match="record 0.*1 image place"):
        PromptDataset(_write_jsonl(tmp_path / "p.jsonl", rows), DataConfig())


def test_bad_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"text": "no prompt column"}\n')
    with pytest.raises(DataError, match=r"record 1.*no prompt \(columns present: text\)"):
        PromptDataset(str(path), DataConfig())
    path.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        list(read_rows(str(path)))
    with pytest.raises(DataError, match="not found"):
        PromptDataset(str(tmp_path / "missing.jsonl"), DataConfig())


def test_parquet_with_image_bytes(tmp_path, make_processor):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    image = solid_image(seed=5)
    image.save(buf, format="PNG")
    table = pa.table({"prompt": ["<image>color?", "plain"],
                      "images": [[{"bytes": buf.getvalue(), "path": "x.png"}], []],
                      "reference": ["red", None]})
    pq.write_table(table, tmp_path / "p.parquet")
    ds = PromptDataset(str(tmp_path / "p.parquet"), DataConfig())
    assert len(ds) == 2 and ds[1].images == [] and ds[1].reference is None
    out = make_processor().process_records(list(ds), 1)
    assert out.all_images[0][0].tobytes() == image.tobytes()


def test_saved_dataset_folder_keeps_images_encoded(tmp_path, make_processor):
    import datasets

    images = [solid_image(seed=1), solid_image((84, 56), seed=2)]
    data = datasets.Dataset.from_dict(
        {"prompt": ["<image>a", "<image>b", "c"], "images": [[images[0]], [images[1]], []],
         "label": ["x", "y", "z"]},
        features=datasets.Features({"prompt": datasets.Value("string"),
                                    "images": datasets.Sequence(datasets.Image()),
                                    "label": datasets.Value("string")}))
    data.save_to_disk(str(tmp_path / "ds"))
    ds = PromptDataset(str(tmp_path / "ds"), DataConfig())
    assert len(ds) == 3 and isinstance(ds[0].images[0], dict) and ds[0].images[0]["bytes"]
    out = make_processor().process_records(list(ds), 1)
    assert [im[0].tobytes() for im in out.all_images[:2]] == [im.tobytes() for im in images]
    assert out.all_labels == ["x", "y", "z"]


def test_several_files_index_across(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1"}, {"prompt": "2"}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "3"}])
    ds = PromptDataset([a, b], DataConfig())
    assert [r.index for r in ds] == [0, 1, 2] and ds[2].source == b
    assert [len(batch) for batch in ds.batches(2)] == [2, 1]


def test_record_errors_in_processor_name_the_file(tmp_path, media, make_processor):
    rows = [{"id": "a", "prompt": "ok"}, {"id": "b", "prompt": "<image>x", "images": "broken.png"}]
    ds = PromptDataset(_write_jsonl(tmp_path / "p.jsonl", rows), DataConfig())
    with pytest.raises(DataError, match=r"record 1 \(id='b'\), field 'images', file '.*broken\.png'"):
        make_processor().process_records(list(ds), 2)


def test_parquet_chat_parts_with_null_keys(tmp_path, make_processor, media):
    """Parquet gives every part every key (``"image": None`` on text parts): no phantom images."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [[{"role": "user", "content": [{"type": "image", "image": media["img0"], "text": None},
                                              {"type": "text", "image": None, "text": "colour?"}]}]]
    pq.write_table(pa.table({"prompt": messages}), tmp_path / "chat.parquet")
    ds = PromptDataset(str(tmp_path / "chat.parquet"), DataConfig())
    assert ds[0].images == [media["img0"]]
    out = make_processor().process_records(list(ds), 1)
    assert out.all_prompts[0].count("<|vision_start|>") == 1 and out.all_prompts[0].count("colour?") == 1


def test_json_array_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}], indent=2))
    assert [r.record_id for r in PromptDataset(str(path), DataConfig())] == [1, 2]
