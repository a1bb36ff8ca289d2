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

    def as_info(self, total: float) -> dict[str, float]:
        """``time/<phase>`` seconds plus ``time/other`` (total minus the named phases) and ``time/total``."""
        info = {f"time/{k}": v for k, v in self.seconds.items()}
        info["time/other"] = max(total - sum(self.seconds.values()), 0.0)
        info["time/total"] = total
        return info
