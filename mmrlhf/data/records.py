"""One dataset row -> :class:`PromptRecord`: column mapping, item lists, and the per-record placeholder check.

Why check placeholders here: a prompt with two ``<image>`` markers and three images is a data bug. Caught at load
time, the message names the row; caught by the HF processor it is an anonymous shape error, and not caught at all
the model reads the wrong image for a question.
"""

from __future__ import annotations

from typing import Any, Optional

from mmrlhf.data.errors import DataError
from mmrlhf.data.prompts import count_slots, iter_parts, part_kind
from mmrlhf.data.types import PromptRecord


def as_image_list(value: Any) -> list:
    """Images of a row: None -> [], one item -> [item], a list -> the list (each element one image)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def as_video_list(value: Any) -> list:
    """Videos of a row. A bare path or ``{"video": ..}`` dict is one video; a list is a list of videos, so a video
    given as frames is a list inside the list (``[[frame0, frame1, ...]]``)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)  # NaN from pandas-written files


def items_from_parts(prompt: list, kind: str) -> list:
    """Image / video items embedded in chat content parts (``{"type": "image", "image": "a.png"}``)."""
    out = []
    for part in iter_parts(prompt):
        if part_kind(part) == kind:
            value = part.get(kind) if kind in part else part.get("image_url")
            if isinstance(value, dict) and "url" in value:
                value = value["url"]
            if value is not None:
                out.append(value)
    return out


def row_videos(row: dict, columns: Any) -> list:
    """The videos of a raw row (undecoded): its ``data.video_key`` column, else the video parts of its chat prompt.
    The one definition, for records and for the scans that look at the data before any model loads."""
    videos = as_video_list(None if _is_missing(row.get(columns.video_key)) else row.get(columns.video_key))
    prompt = row.get(columns.prompt_key)
    if not videos and isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        videos = items_from_parts(prompt, "video")
    return videos


def record_from_row(row: dict, index: int, columns: Any, *, base_dir: Optional[str] = None,
                    source: Optional[str] = None) -> PromptRecord:
    """Build and validate a record. ``columns``: a ``DataConfig`` (its ``*_key`` and placeholder fields)."""
    record_id = row.get(columns.id_key)
    record_id = None if _is_missing(record_id) else record_id

    def fail(message: str, field: str, reason: str = "bad_record") -> DataError:
        return DataError(message, reason=reason, index=index, record_id=record_id, field=field, file=source)

    prompt = row.get(columns.prompt_key)
    if _is_missing(prompt):
        present = ", ".join(sorted(map(str, row))) or "none"
        raise fail(f"no prompt (columns present: {present}); set data.prompt_key", columns.prompt_key)
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(isinstance(m, dict)
                                                                                  for m in prompt)):
        raise fail(f"prompt must be text or a list of chat messages, got {type(prompt).__name__}", columns.prompt_key)

    images = as_image_list(None if _is_missing(row.get(columns.image_key)) else row.get(columns.image_key))
    videos = row_videos(row, columns)
    if isinstance(prompt, list) and not images:
        images = items_from_parts(prompt, "image")
    check_slots(prompt, len(images), len(videos), columns.image_placeholder, columns.video_placeholder,
                index=index, record_id=record_id, file=source, field=columns.prompt_key)

    label = row.get(columns.label_key)
    reference = row.get(columns.reference_key)
    return PromptRecord(index=index, prompt=prompt, images=images, videos=videos,
                        label=None if _is_missing(label) else label,
                        reference=None if _is_missing(reference) else reference,
                        record_id=record_id, base_dir=base_dir, source=source, extras=extra_columns(row, columns))


def extra_columns(row: dict, columns: Any) -> dict[str, Any]:
    """The row's columns that no ``data.*_key`` maps: kept as they are for tools and environments."""
    mapped = {columns.prompt_key, columns.image_key, columns.video_key, columns.label_key, columns.reference_key,
              columns.id_key}
    return {name: value for name, value in row.items() if name not in mapped}


def check_slots(prompt: Any, n_images: int, n_videos: int, image_placeholder: str, video_placeholder: str, *,
                index: Optional[int], record_id: Any = None, file: Optional[str] = None,
                field: str = "prompt") -> None:
    """Raise unless the prompt has exactly one place per image and per video."""
    slots_img, slots_vid = count_slots(prompt, image_placeholder, video_placeholder)
    problems = []
    if slots_img != n_images:
        problems.append(f"{slots_img} image place(s) ({image_placeholder!r} or image parts) for {n_images} image(s)")
    if slots_vid != n_videos:
        problems.append(f"{slots_vid} video place(s) ({video_placeholder!r} or video parts) for {n_videos} video(s)")
    if problems:
        raise DataError("; ".join(problems) + ": put one placeholder where each item goes",
                        reason="placeholder_mismatch", index=index, record_id=record_id, field=field, file=file)
