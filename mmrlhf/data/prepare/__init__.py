"""Data preparation: public datasets, as published, -> the project's prompt-record JSONL (docs/data.md).

``python -m mmrlhf.data.prepare NAME INPUT [INPUT ...] --output OUT.jsonl`` (``--help`` lists the options). Each
converter (one module per dataset shape) maps one published row to one record; reading, image extraction, error
reporting, skipping, writing and the load-back check are shared (:mod:`mmrlhf.data.prepare.common`).
"""

from __future__ import annotations

from mmrlhf.data.prepare import clevr_count, deepeyes, geometry3k, multi_image, open_vqa, video_qa
from mmrlhf.data.prepare.common import Converter, Summary, convert

CONVERTERS: dict[str, Converter] = {
    "geometry3k": geometry3k.convert_row,
    "clevr_count": clevr_count.convert_row,
    "multi_image": multi_image.convert_row,
    "video_qa": video_qa.convert_row,
    "deepeyes": deepeyes.convert_row,
    "open_vqa": open_vqa.convert_row,
}


def prepare(name: str, inputs: list[str], output: str, **options) -> Summary:
    """Convert ``inputs`` with the converter called ``name``; ``options`` go to :func:`~.common.convert`."""
    if name not in CONVERTERS:
        raise KeyError(f"unknown dataset converter {name!r}; known: {', '.join(sorted(CONVERTERS))}")
    return convert(CONVERTERS[name], list(inputs), output, **options)


__all__ = ["CONVERTERS", "Summary", "convert", "prepare"]
