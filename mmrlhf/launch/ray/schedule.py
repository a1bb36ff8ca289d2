"""``RolloutSchedule``: which rollouts the rollout actors are asked for, and what happens when one of them dies.
Trainer rank 0 owns it.

Why a module of its own: the staleness window (at step ``t`` every step up to ``t + k`` is asked for, with a policy
version ``>= s - k`` for step ``s``), the requests in flight and the restart policy (``distributed.on_rollout_failure``)
are one piece of state that changes together: a restarted actor's unfinished requests are asked for again, a lost
actor stops the run at the next collect. The weights a restarted actor needs come from the caller
(:class:`CurrentWeights`), so this module never touches tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from mmrlhf.launch.ray.holder import holder_name
from mmrlhf.launch.ray.ledger import min_rollout_version
from mmrlhf.trainer.reporting import is_report_step
from mmrlhf.trainer.rollouts import RolloutSourceError

logger = logging.getLogger(__name__)


class RolloutActorFailure(RolloutSourceError):
    """A rollout actor died and the run may not (or can no longer) restart it."""


class CurrentWeights(Protocol):
    """What a restarted rollout actor is given (the weight delivery)."""

    def held(self) -> bool:
        """Whether a current version exists to give (none before the first push)."""

    def resend(self, share: int) -> str | None:
        """The current version to rollout actor ``share``: ``None``, or the error it died of receiving it."""


@dataclass(frozen=True)
class ScheduleSettings:
    max_steps: int
    max_staleness: int
    on_rollout_failure: str  # "stop" | "restart"
    max_actor_restarts: int
    report_steps: int = 0  # trainer.report_steps: the steps whose report samples rollout actor 0 sends


class RolloutSchedule:
    """The requests of rank 0 to the rollout actors of ``pool`` under the staleness bound."""

    def __init__(self, pool: Any, settings: ScheduleSettings, weights: CurrentWeights) -> None:
        self.pool, self.s, self.weights = pool, settings, weights
        self.pending: dict[tuple[int, int], tuple[Any, Any]] = {}  # (step, share) -> (metadata ref, data ref)
        self.submitted = -1
        self.restarts = [0] * pool.count  # this run's, per rollout actor (each has its own restart budget)
        self.restarts_before = 0  # what the runs before a resume restarted (the metric counts the whole run)
        self.failures: list[str] = []
        self.deferred: str | None = None  # why the run must stop (a rollout actor lost): raised at the next collect
        # (shares, step): rollout actors begin at ``step`` (a restarted one: its running state and stream as they
        # stood before it, RayRollouts._place); by default only the step they generate in order from
        self.place: Callable[[Sequence[int], int], None] = self._expect

    def ask_ahead(self, step: int) -> None:
        """Every step up to ``step + k`` asked for (the last one the run trains at most); raises when a rollout actor
        was lost since the last call."""
        if self.deferred is not None:
            raise RolloutActorFailure(self.deferred)
        while self.submitted < min(step + self.s.max_staleness, self.s.max_steps - 1):
            self.submit_step(self.submitted + 1)

    def submit_step(self, step: int, replays: dict[int, dict[str, Any]] | None = None) -> None:
        """Ask every rollout actor for its share of ``step``; ``replays`` (a resume of partial rollouts): per share,
        the segment versions the checkpoint recorded and their tensors (``ExperienceMakerHolder.generate``)."""
        for share in range(self.pool.count):
            self._submit(step, share, (replays or {}).get(share))
        self.submitted = max(self.submitted, step)

    def _submit(self, step: int, share: int, replay: dict[str, Any] | None = None) -> None:
        """One request; a report step's asks rollout actor 0 (the report's share, as rank 0's in torchrun) for the
        samples the report shows, so a regenerated batch brings them too."""
        args = (step, min_rollout_version(step, self.s.max_staleness)) + (() if replay is None else (replay,))
        report = share == 0 and is_report_step(step + 1, self.s.report_steps, self.s.max_steps)
        meta, data = self.pool.handles[share].generate.options(num_returns=2).remote(*args, report=report)
        self.pending[(step, share)] = (meta, data)

    def await_share(self, step: int, share: int) -> dict[str, Any]:
        """The metadata of ``step``'s share from rollout actor ``share``, restarting the actor (and regenerating its
        unfinished batches) when it died and the policy allows."""
        import ray

        from mmrlhf.parallel.ray_actors import describe_actor_error

        while True:
            try:
                return ray.get(self.pending[(step, share)][0])
            except ray.exceptions.RayActorError as exc:
                self.on_failure(share, describe_actor_error(exc))

    def take(self, step: int) -> list[dict[str, Any]]:
        """The payloads (metadata and experiences) of every share of ``step``, awaited; no longer in flight."""
        import ray

        payloads = ray.get([self.pending[(step, share)][1] for share in range(self.pool.count)])
        for share in range(self.pool.count):
            del self.pending[(step, share)]
        return payloads

    def in_flight(self) -> list[dict[str, Any]]:
        """The steps asked for and not taken yet, in order, each with the policy version that generated it (awaited:
        what a checkpoint records to regenerate them). Partial rollouts (segment versions in the metadata) also
        record, per share, the version of every segment of every engine call (``segments``), and ``version`` is the
        oldest of them."""
        out = []
        for step in sorted({step for step, _ in self.pending}):
            metas = [self.await_share(step, share) for share in range(self.pool.count)]
            if any(m.get("segment_versions") for m in metas):
                out.append({"step": step, "version": min(m["version"] for m in metas),
                            "segments": {str(m["share"]): m["segment_versions"] for m in metas}})
                continue
            versions = {m["version"] for m in metas}
            if len(versions) != 1:
                raise RuntimeError(f"step {step} in flight with several versions {sorted(versions)}")
            out.append({"step": step, "version": versions.pop()})
        return out

    def on_failures(self, failed: dict[int, str]) -> None:
        """Rollout actors that died receiving weights (``{share: error}``): the first the run cannot restart stops
        handling (the run learns it at the next collect, saves and stops)."""
        for share, error in failed.items():
            try:
                self.on_failure(share, error)
            except RolloutActorFailure:
                break

    def on_failure(self, share: int, error: str) -> None:
        """Apply ``distributed.on_rollout_failure`` to the death of rollout actor ``share``."""
        message = f"rollout actor {holder_name(share)!r} died: {error}"
        self.failures.append(message)
        logger.error(message)
        s = self.s
        if s.on_rollout_failure == "stop" or self.restarts[share] >= s.max_actor_restarts or not self.weights.held():
            why = ("distributed.on_rollout_failure=stop" if s.on_rollout_failure == "stop" else
                   f"distributed.max_actor_restarts={s.max_actor_restarts} reached")
            self.deferred = f"{message} ({why})"  # the run stops: a save must not wait on the dead actor
            raise RolloutActorFailure(self.deferred)
        self.restarts[share] += 1
        self.pool.restart(share)
        failed = self.weights.resend(share)
        if failed:
            self.deferred = f"restarted {holder_name(share)!r} died again: {failed}"
            raise RolloutActorFailure(self.deferred)
        lost = sorted(key for key in self.pending if key[1] == share)
        self.place([share], lost[0][0] if lost else self.submitted + 1)  # where the new actor begins
        for step, _ in lost:  # nothing of these reached the trainer (the ledger would refuse a second delivery)
            self._submit(step, share)
        logger.warning("restarted %r (%d/%d); regenerating steps %s", holder_name(share), self.restarts[share],
                       s.max_actor_restarts, [st for st, _ in lost])

    def _expect(self, shares: Sequence[int], step: int) -> None:
        import ray

        ray.get([self.pool.handles[i].expect.remote(step) for i in shares])

    def restarted(self) -> int:
        """Rollout actor restarts over the whole run (resumes included)."""
        return self.restarts_before + sum(self.restarts)
