"""Bad-input handling shared by the loaders and the processor: one error type, one skip ledger.

Why one place: the same policy ("raise naming the record" or "skip, count and log") applies to a corrupt image, a
zero-frame video, a placeholder mismatch and an over-long prompt. Every failure is turned into a :class:`DataError`
that carries the record's index / id, the field and the file, so the message a user reads points at the row to
fix. In skip mode the same error is recorded in a :class:`SkipLog` (counted by reason, logged once per record):
nothing is dropped silently.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

logger = logging.getLogger("mmrlhf.data")

OnBadInput = Literal["error", "skip"]


def describe_record(index: Optional[int], record_id: Any = None) -> str:
    """``record 12 (id='abc')``: how every message names a record."""
    where = f"record {index}" if index is not None else "record"
    if record_id is not None:
        where += f" (id={record_id!r})"
    return where


class DataError(ValueError):
    """A record that cannot be used. ``reason`` is a short stable key (the skip counter's label)."""

    def __init__(self, message: str, *, reason: str, index: Optional[int] = None, record_id: Any = None,
                 field: Optional[str] = None, file: Optional[str] = None) -> None:
        self.reason = reason
        self.index = index
        self.record_id = record_id
        self.field = field
        self.file = file
        self.detail = message
        parts = [describe_record(index, record_id)]
        if field:
            parts.append(f"field {field!r}")
        if file:
            parts.append(f"file {file!r}")
        super().__init__(f"{', '.join(parts)}: {message}")

    def located(self, *, index: Optional[int] = None, record_id: Any = None,
                field: Optional[str] = None) -> "DataError":
        """A copy that also names the record (loaders below the record level do not know it)."""
        return DataError(self.detail, reason=self.reason,
                         index=self.index if index is None else index,
                         record_id=self.record_id if record_id is None else record_id,
                         field=self.field or field, file=self.file)


@dataclass
class Skipped:
    """One skipped record: where it was and why."""

    index: Optional[int]
    record_id: Any
    reason: str
    message: str


@dataclass
class SkipLog:
    """Counts and remembers skipped records; ``handle`` applies the error policy."""

    on_bad_input: OnBadInput = "error"
    counts: Counter = field(default_factory=Counter)
    items: list[Skipped] = field(default_factory=list)
    max_items: int = 1000  # keep memory bounded on long runs; the counts stay exact

    def handle(self, err: DataError) -> None:
        """Raise ``err`` in error mode; otherwise count it, remember it and log it."""
        if self.on_bad_input == "error":
            raise err
        self.record(err)

    def record(self, err: DataError) -> None:
        self.counts[err.reason] += 1
        if len(self.items) < self.max_items:
            self.items.append(Skipped(err.index, err.record_id, err.reason, str(err)))
        logger.warning("skipping %s (total skipped for %r: %d)", err, err.reason, self.counts[err.reason])

    def merge(self, other: "SkipLog") -> None:
        """Add another log's counts and items (e.g. one batch's) to this one."""
        self.counts.update(other.counts)
        room = max(0, self.max_items - len(self.items))
        self.items.extend(other.items[:room])

    @property
    def total(self) -> int:
        return sum(self.counts.values())
