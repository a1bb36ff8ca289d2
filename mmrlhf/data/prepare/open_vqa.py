"""Open-ended visual questions and captions, which a judge grades rather than a rule matches: one image per row, as
captioning and free-form VQA sets publish them in Parquet / JSON (lmms-lab/COCO-Caption2017's layout is one:
``image`` as ``{bytes, path}``, ``question`` the captioning instruction, ``answer`` the list of human captions,
``question_id``).

Image: ``image`` / ``image_path`` (a path or ``{bytes, path}``) or a one-item ``images`` list. Question:
``question`` / ``query`` / ``instruction``; a caption set without one gets :data:`CAPTION_INSTRUCTION`. Reference:
``answer`` / ``answers`` / ``caption`` / ``captions`` / ``gpt_answer``, one text or a list of texts (several
acceptable answers, e.g. five captions), kept as a list then: the judge's rubric shows them all.

Label ``open``: no rule can score a free-form answer against a reference sentence, so the recipe weighs a judge.
"""

from __future__ import annotations

from mmrlhf.data.prepare.common import MediaStore, Row, place_items, record

CAPTION_INSTRUCTION = "Describe the image in one sentence."
"""The question of a row that has none (a plain caption set)."""

_REFERENCE = ("answer", "answers", "caption", "captions", "gpt_answer")


def convert_row(row: Row, media: MediaStore) -> dict:
    raw = row.get("image", "image_path", "images")
    if isinstance(raw, (list, tuple)):
        if len(raw) != 1:
            raise row.fail(f"expected one image, got {len(raw)}", "images")
        raw = raw[0]
    image = media.image(raw, row, "image")
    question = row.get("question", "query", "instruction", required=False)
    if question is not None and not isinstance(question, str):
        raise row.fail(f"expected text, got {type(question).__name__}", "question / query / instruction")
    prompt = place_items((question or CAPTION_INSTRUCTION).strip(), 1, "<image>", row, "question")
    return record(row, "open", prompt, images=[image], label="open", reference=_reference(row))


def _reference(row: Row) -> str | list[str]:
    field = " / ".join(_REFERENCE)
    value = row.get(*_REFERENCE)
    if isinstance(value, str):
        return value.strip()
    if not isinstance(value, (list, tuple)):
        raise row.fail(f"expected a text or a list of texts, got {type(value).__name__}", field)
    texts = [v.strip() for v in value if isinstance(v, str) and v.strip()]
    if len(texts) != len(value) or not texts:
        raise row.fail(f"expected a non-empty list of non-empty texts, got {list(value)[:5]!r}", field)
    return texts[0] if len(texts) == 1 else texts
