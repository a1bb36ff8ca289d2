"""CLEVR-style counting as published in JSON / JSONL (or Parquet) releases: one image per row, given as a file
path relative to the image folder (``image`` / ``image_path``) or as ``{"bytes", "path"}``; the question in
``problem`` / ``question``; the count in ``solution`` / ``answer``, bare (``"3"``) or wrapped
(``"<answer> 3 </answer>"``).

Label ``count``, reference the count as a string: the recipes score it with ``numeric_match``. A reference that is
not a whole number is an error naming the row (a count reward against it would always be 0).
"""

from __future__ import annotations

from mmrlhf.data.prepare.common import MediaStore, Row, is_ascii_whole_number, place_items, record, unwrap_answer


def convert_row(row: Row, media: MediaStore) -> dict:
    raw = row.get("image", "image_path", "images")
    if isinstance(raw, list):
        if len(raw) != 1:
            raise row.fail(f"expected one image, got {len(raw)}", "images")
        raw = raw[0]
    image = media.image(raw, row, "image")
    prompt = place_items(row.text("problem", "question"), 1, "<image>", row, "problem")
    count = unwrap_answer(row.text("solution", "answer"))
    if not is_ascii_whole_number(count):
        raise row.fail(f"expected a whole-number count in ASCII digits, got {count!r}", "solution / answer")
    return record(row, "clevr", prompt, images=[image], label="count", reference=str(int(count)))
