"""The order the test suite hands its files to its workers: longest first.

The suite runs on two pytest-xdist workers that take whole files (``--dist loadfile``) in collection order
(``--no-loadscope-reorder``; xdist's own order puts the files with the most tests first, so the few long launch-mode
files, with few tests each, came last and one of them ran alone at the end while the other worker idled). A table of
measured seconds per file (tests/durations.json, written by scripts/test_durations.py) puts the long ones first; the
short ones fill in at the end.

Each worker also gets its share of the cores for OpenMP (:func:`worker_threads`, set by tests/conftest.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Sequence

_LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+?\.py)::")


def file_seconds(log: str) -> dict[str, float]:
    """Seconds per test file in a pytest log's durations table (setup, call and teardown summed)."""
    total: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = _LINE.match(line)
        if m:
            total[m.group(3)] += float(m.group(1))
    return dict(total)


def longest_files_first(items: Sequence[Any], seconds: dict[str, float]) -> list[Any]:
    """``items`` (pytest items: a ``nodeid`` each) with their files ordered by measured seconds, longest first, each
    file's tests in their own order. A file the table does not list counts as short (the table may hold only the
    files of the slowest tests: the ones whose place matters) and keeps its collection order after the listed ones."""
    files = list(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in items))
    rank = {f: (-seconds.get(f, 0.0), i) for i, f in enumerate(files)}
    return sorted(items, key=lambda item: rank[item.nodeid.split("::", 1)[0]])


def worker_threads(cores: int, workers: int) -> int:
    """OpenMP threads for each of ``workers`` pytest workers on ``cores`` cores: an even share, at least one.

    Why: left at OpenMP's default (every core), two workers run twice as many OpenMP threads as there are cores,
    and every parallel region's barrier then waits on a descheduled thread. Measured side by side on the 2-core
    machine, the agent toy and the one-process GRPO toy took 484 s and 418 s running together at the default, 200 s
    and 55 s at one thread each, with the same curves."""
    return max(1, cores // max(1, workers))
