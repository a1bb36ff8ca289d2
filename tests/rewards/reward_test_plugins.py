"""Reward functions used by the tests, loaded by file path (``tests/rewards/reward_test_plugins.py:name``)."""

from __future__ import annotations

import asyncio
import time


def echo_number(responses, prompts, labels, references, **columns):
    """Score = the response parsed as a float (lets tests check alignment)."""
    return [float(r) for r in responses]


def slow_echo(responses, prompts, labels, references):
    time.sleep(0.1)
    return [float(r) for r in responses]


async def async_len(responses, prompts, labels, references):
    await asyncio.sleep(0)
    return [float(len(r)) for r in responses]


def with_parts(responses, prompts, labels, references):
    """Named parts; samples whose reference is None do not apply."""
    out = []
    for r, ref in zip(responses, references):
        if ref is None:
            out.append(None)
        else:
            fmt = 1.0 if r.startswith("<") else 0.0
            acc = 1.0 if ref in r else 0.0
            out.append({"overall": 0.5 * fmt + acc, "format": fmt, "accuracy": acc})
    return out


def image_widths(responses, prompts, labels, references, images=None):
    """Sum of the widths of each sample's images (checks images arrive, decoded, in order)."""
    return [float(sum(img.size[0] for img in imgs)) for imgs in images]


def needs_column(responses, prompts, labels, references, difficulty):
    return [float(d) for d in difficulty]


def fails_on_bad(responses, prompts, labels, references):
    """Raises if any response is 'bad' (batched), NaN for 'nan'."""
    if "bad" in responses:
        raise ValueError("cannot score 'bad'")
    return [float("nan") if r == "nan" else 1.0 for r in responses]


def drops_one(responses, prompts, labels, references):
    return [1.0] * (len(responses) - 1)


def sleep_echo(responses, prompts, labels, references, delay=0.2):
    """A slow synchronous rule: sleeps ``delay`` seconds (the GIL is released), then echoes the numbers."""
    time.sleep(delay)
    return [float(r) for r in responses]


REFERENCE_KINDS = {type(None): 0.0, int: 1.0, float: 2.0, str: 3.0, list: 4.0, dict: 5.0, bool: 6.0}


def reference_kind(responses, prompts, labels, references):
    """Scores the Python type of each reference (checks references arrive as they were sent, not as text)."""
    return [REFERENCE_KINDS.get(type(ref), -1.0) for ref in references]
