"""The environment sessions a step holds, and closing them on every exit path of the step (both turn loops).

Why a ledger: an environment is a session on a backend (a sandbox, a browser, a game server), and a step that
raises (an engine error, a Ctrl-C, a bug) must not leave its sessions open behind it, live or pooled. Every
environment the step made or took from its pool is entered when it is made and leaves when it is handed to a
close; on the way out the step closes whatever is still entered.

A close runs under the tool deadline like any environment call, all of them at once (a close that blocks is
answered ``timeout`` and its thread abandoned, so closing never holds a step past the deadline). A close that fails
is counted under its kind in ``agent/errors/<kind>/count``; when the step itself is failing its counts go down with
it, so the failed closes are logged as well, never swallowed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from mmrlhf.agents.loop_types import LoopStats

logger = logging.getLogger(__name__)


def count_close_failures(stats: LoopStats, closed: Sequence[tuple[Any, float]]) -> int:
    """Count each close in ``closed`` (the runner's answers) that failed, under its kind; returns how many."""
    failed = 0
    for failure, _ in closed:
        if failure is not None:
            stats.errors[failure.error] = stats.errors.get(failure.error, 0) + 1
            failed += 1
    return failed


class Sessions:
    """The environments one step holds open (made, or taken from its pool, and not yet handed to a close)."""

    def __init__(self, runner: Any, stats: LoopStats) -> None:
        self.runner, self.stats = runner, stats
        self._open: dict[int, Any] = {}

    def opened(self, env: Any) -> None:
        if env is not None:
            self._open[id(env)] = env

    def closing(self, env: Any) -> None:
        """``env`` is handed to a close elsewhere (the asynchronous loop's observer thread)."""
        self._open.pop(id(env), None)

    @property
    def held(self) -> int:
        return len(self._open)

    def close(self, envs: Sequence[Any]) -> float:
        """Close ``envs`` now, under the deadline, counting failed closes; the seconds it took."""
        for env in envs:
            self.closing(env)
        if not envs:
            return 0.0
        t0 = time.perf_counter()
        count_close_failures(self.stats, self.runner.run_environment_closes(list(envs)))
        return time.perf_counter() - t0

    def close_all(self, *, failing: bool) -> float:
        """Close every environment still held. ``failing``: the step is raising; a close that fails is logged
        (its count would be lost with the step), and one that cannot run at all (the runner closed) is logged,
        never raised over the step's own error."""
        envs = list(self._open.values())
        if not failing:
            return self.close(envs)
        self._open.clear()
        if not envs:
            return 0.0
        t0 = time.perf_counter()
        try:
            failed = count_close_failures(self.stats, self.runner.run_environment_closes(envs))
        except Exception as exc:  # noqa: BLE001 - the step's own error is the one raised; this one is logged
            logger.warning("the step failed, and its %d open environments could not be closed: %s: %s", len(envs),
                           type(exc).__name__, exc)
            return time.perf_counter() - t0
        if failed:
            logger.warning("the step failed; closing its %d open environments, %d closes failed (counted under "
                           "agent/errors/<kind>, lost with the step)", len(envs), failed)
        return time.perf_counter() - t0
