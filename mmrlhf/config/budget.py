"""The value of a ``max_tokens_per_micro_batch`` key (``trainer`` and ``rollout``), checked in one place for the
config and for the planner that reads it (:mod:`mmrlhf.parallel.micro_batches`)."""

from __future__ import annotations

from typing import Any, Literal, Union

Budget = Union[int, Literal["auto"], None]


def check_budget(value: Any, key: str) -> Budget:
    """``value`` as a budget: None (the count split), ``"auto"`` or a positive number of tokens; the error names
    ``key``."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive number of tokens, 'auto' or null, got {value!r}")
    return value
