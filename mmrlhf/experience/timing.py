"""Per-phase wall-clock accounting for the experience maker's ``info``."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class PhaseTimer:
    """Accumulates seconds per named phase: ``with timer("generate"): ...``; ``timer.seconds`` maps name -> s."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def move(self, seconds: float, *, source: str, target: str) -> None:
        """Count ``seconds`` of phase ``source`` as phase ``target`` instead (a phase that ran inside another, e.g. the
        tool calls inside an agent's generation, reported on its own)."""
        if seconds < 0 or seconds > self.seconds.get(source, 0.0) + 1e-9:
            raise ValueError(f"cannot move {seconds:.6f} s out of phase {source!r}, which has "
                             f"{self.seconds.get(source, 0.0):.6f} s")
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds

    def with_other(self, total: float) -> dict[str, float]:
        """Seconds per phase plus ``other``: what ``total`` spent outside the named phases."""
        return {**self.seconds, "other": max(total - sum(self.seconds.values()), 0.0)}
