"""Left truncation of a prompt's TEXT: the oldest text tokens go, vision blocks stay whole.

Why not the tokenizer's ``truncation=True``: it cuts at a position, so a long prompt loses the tail (or head) of an
image's pad tokens and the pixel values no longer match the ids; the model then fails on "image features and
image tokens do not match" long after the data was read. Keeping every vision-block token (start, pads, end) and
dropping the earliest text tokens keeps ids and grids consistent and keeps the newest text, usually the question.
"""

from __future__ import annotations

from typing import Optional


def truncate_text_left(ids: list[int], mm_types: list[int], max_len: int,
                       vision_ids: frozenset[int]) -> Optional[tuple[list[int], list[int]]]:
    """``(ids, mm_types)`` shortened to ``max_len`` by dropping the earliest non-vision tokens, or None when the
    vision tokens alone exceed ``max_len``. Inputs are left unchanged; linear in ``len(ids)``."""
    excess = len(ids) - max_len
    if excess <= 0:
        return ids, mm_types
    keep = [t in vision_ids for t in ids]  # vision tokens always stay
    dropped = 0
    for k, is_vision in enumerate(keep):
        if not is_vision:
            if dropped == excess:
                keep[k] = True
            else:
                dropped += 1
    if dropped < excess:
        return None
    return [t for t, k in zip(ids, keep) if k], [t for t, k in zip(mm_types, keep) if k]
