"""Geometry3K as published on the Hugging Face hub (Parquet): ``images`` (a list of ``{"bytes", "path"}``),
``problem`` (text that already holds one ``<image>`` per image) and ``answer`` (``"3"``, ``"\\frac{2}{3}"``, ...).

Label ``math``: the recipes score it with the format rule and ``math_accuracy`` (math-verify), which reads LaTeX
answers such as ``\\frac{2}{3}`` and ``2\\sqrt{3}`` as the published references write them.
"""

from __future__ import annotations

from mmrlhf.data.prepare.common import MediaStore, Row, place_items, record


def convert_row(row: Row, media: MediaStore) -> dict:
    raw = row.get("images", "image")
    items = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if not items:
        raise row.fail("no image", "images")
    images = [media.image(item, row, "images") for item in items]
    prompt = place_items(row.text("problem", "question"), len(images), "<image>", row, "problem")
    return record(row, "geometry3k", prompt, images=images, label="math", reference=row.text("answer"))
