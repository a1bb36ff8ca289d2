"""Left truncation of a prompt's TEXT: the oldest text tokens go, vision blocks stay whole.

Why not the tokenizer's ``truncation=True``: it cuts at a position, so a long prompt loses the tail (or head) of an
image's pad tokens and the pixel values no longer match the ids; the model then fails on "image features and
image tokens do not match" long after the data was read. Keeping every vision-block token (start, pads, end) and
dropping the earliest text tokens keeps ids and grids consistent and keeps the newest text, usually the question.
The system turn is kept whole too: it holds the task's instructions, which matter more than the oldest user text.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

from mmrlhf.data.errors import describe_record

logger = logging.getLogger("mmrlhf.data")


def structure_mask(ids: Sequence[int], *, special_ids: frozenset[int], vision_start: int, vision_end: int,
                   is_newline: Callable[[int], bool], role_of: Optional[Callable[[list[int]], str]] = None,
                   keep_roles: frozenset[str] = frozenset()) -> list[bool]:
    """Tokens that hold the prompt's structure and must survive truncation (linear in ``len(ids)``):

    - special tokens (turn markers, vision markers and pads);
    - everything inside a vision block, nesting included (Qwen3-VL writes frame timestamps as text there);
    - the role header after a non-vision special token, up to its first newline (``<|im_start|>user\n``), so a
      truncated prompt still starts a proper turn and still ends with the generation prompt;
    - every token of a turn whose role (``role_of(header tokens)``) is in ``keep_roles``: the system turn carries
      the task's instructions, so the user's text is cut, never the instructions.
    """
    out = [False] * len(ids)
    depth = 0
    header: Optional[list[int]] = None  # tokens of the role header being read, None outside a header
    keep_turn = False
    for i, tok in enumerate(ids):
        if tok == vision_start:
            depth += 1
        if tok in special_ids:
            out[i] = True
            if tok not in (vision_start, vision_end) and depth == 0:  # a turn marker: a new turn (or turn end)
                header, keep_turn = [], False
            else:
                header = None
        elif depth > 0 or header is not None or keep_turn:
            out[i] = True
            if header is not None:
                header.append(tok)
                if is_newline(tok):
                    keep_turn = role_of is not None and role_of(header) in keep_roles
                    header = None
        if tok == vision_end and depth > 0:
            depth -= 1
    return out


def collapse_vision_blocks(ids: Sequence[int], *, vision_start: int, vision_end: int,
                           pad_ids: frozenset[int]) -> list[int]:
    """``ids`` with every outermost vision block written back as the chat template writes it, before the processor
    expands it: ``[vision_start, pad, vision_end]``.

    Why: engines that take prompt TEXT (vLLM for Qwen3-VL videos, whose expansion interleaves timestamp text with
    the pads) run the processor on that text again; the text must therefore hold each item's unexpanded
    sequence, and its plain tokenisation must equal this collapsed form. A block without a pad (or left open) is
    kept as it is, so such ids never compare equal to a re-tokenised text by accident."""
    out: list[int] = []
    block: list[int] = []
    depth = 0
    for tok in ids:
        if depth == 0 and tok != vision_start:
            out.append(tok)
            continue
        block.append(tok)
        if tok == vision_start:
            depth += 1
        elif tok == vision_end:
            depth -= 1
            if depth == 0:
                pad = next((t for t in block if t in pad_ids), None)
                out.extend(block if pad is None else (vision_start, pad, vision_end))
                block = []
    out.extend(block)
    return out


def truncate_text_left(ids: list[int], mm_types: list[int], max_len: int,
                       vision_ids: frozenset[int],
                       protected: Optional[Sequence[bool]] = None) -> Optional[tuple[list[int], list[int]]]:
    """``(ids, mm_types)`` shortened to ``max_len`` by dropping the earliest tokens that are neither vision tokens
    nor ``protected`` (see :func:`structure_mask`), or None when the kept tokens alone exceed ``max_len``.
    Inputs are left unchanged; linear in ``len(ids)``."""
    excess = len(ids) - max_len
    if excess <= 0:
        return ids, mm_types
    keep = [t in vision_ids for t in ids]  # vision tokens always stay
    if protected is not None:
        keep = [k or bool(p) for k, p in zip(keep, protected)]
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


def warn_truncated(count: int, limit: int, *, index: Optional[int], record_id: Any, before: int, after: int) -> None:
    """One warning per batch that lost text to ``prompt_max_len``, naming the first such prompt and its lengths.

    Why: a cut is not an error (the default ``prompt_overflow``), but a recipe whose limit is too short for its own
    questions would otherwise train on prompts without their start and never say so; the count alone
    (``truncated_prompts``) is easy to miss."""
    logger.warning("left-truncated %d prompt(s) of this batch to prompt_max_len=%d (data.prompt_overflow="
                   "truncate_left), first %s: %d -> %d tokens; raise data.prompt_max_len or shorten the prompts",
                   count, limit, describe_record(index, record_id), before, after)
