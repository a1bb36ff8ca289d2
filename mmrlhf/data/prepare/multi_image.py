"""Multi-image questions as published in Parquet (or JSON) releases: the images either as one list column
(``images``: ``{"bytes", "path"}`` entries or paths) or as numbered columns ``image_1`` ... ``image_N`` (benchmarks
with a varying image count leave the unused ones empty); the question in ``question`` / ``problem``; optional
options in ``options`` / ``choices`` / ``candidates``; the answer in ``answer`` / ``solution``.

With options: label ``mcq``, the options are appended as ``A. ...`` lines and the reference is the answer's letter
(a published letter, index or option text is mapped to it). Without: label ``short``, reference the answer text.
The question keeps its own ``<image>`` markers when it has one per image; otherwise all images go first, in order.
"""

from __future__ import annotations

import re

from mmrlhf.data.prepare.common import MediaStore, Row, answer_letter, option_lines, place_items, record, \
    unwrap_answer

_NUMBERED = re.compile(r"^image_(\d+)$")


def image_items(row: Row) -> list:
    """The row's images in order: the ``images`` list, else the non-empty ``image_<n>`` columns by ``n``."""
    if row.values.get("images") is not None:
        items = row.values["images"]
        return list(items) if isinstance(items, (list, tuple)) else [items]
    numbered = sorted((int(m.group(1)), key) for key in row.values if (m := _NUMBERED.match(str(key))))
    return [row.values[key] for _, key in numbered if row.values[key] is not None]


def convert_row(row: Row, media: MediaStore) -> dict:
    items = image_items(row)
    if len(items) < 2:
        raise row.fail(f"a multi-image record needs at least 2 images, found {len(items)}", "images / image_<n>")
    images = [media.image(item, row, "images") for item in items]
    question = place_items(row.text("question", "problem"), len(images), "<image>", row, "question")
    options = row.get("options", "choices", "candidates", required=False)
    answer = row.text("answer", "solution")
    if options is None:
        return record(row, "multi_image", question, images=images, label="short", reference=unwrap_answer(answer))
    bare, block = option_lines(options, row, "options")
    prompt = f"{question}\nOptions:\n{block}"
    return record(row, "multi_image", prompt, images=images, label="mcq",
                  reference=answer_letter(answer, bare, row, "answer"))
