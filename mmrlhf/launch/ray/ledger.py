"""Bookkeeping of the asynchronous pipeline, as pure logic (no Ray): the staleness gate, the produced / consumed
ledger and the staleness statistics. The driver and the trainer actor call these; the unit tests drive them alone.

Versions: the policy version is the number of updates applied. Step ``t`` of training runs on version ``t`` and
consumes the experiences of step ``t``; a rollout for step ``s`` may start once the rollout side holds version
``s - k`` (``k`` = ``distributed.max_staleness``), so the experience it yields is at most ``k`` versions old when it
is consumed. The gate makes a staler experience impossible by construction; :func:`check_staleness` still asserts
it at consumption time (a bug there is an error, never a silent off-policy update).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


class StaleExperienceError(RuntimeError):
    """An experience older than ``distributed.max_staleness`` versions reached the trainer (a scheduling bug)."""


class LedgerError(RuntimeError):
    """An experience was delivered twice, never produced, lost, or its sample count changed on the way."""


def min_rollout_version(step: int, max_staleness: int) -> int:
    """The oldest policy version the rollout of ``step`` may be generated with."""
    if step < 0 or max_staleness < 0:
        raise ValueError(f"step and max_staleness must be >= 0, got {step} and {max_staleness}")
    return max(0, step - max_staleness)


def may_start_rollout(step: int, rollout_version: int, max_staleness: int) -> bool:
    """Whether the rollout side, holding ``rollout_version``, may generate the batch of ``step``."""
    return rollout_version >= min_rollout_version(step, max_staleness)


def check_staleness(trainer_version: int, experience_version: int, max_staleness: int) -> int:
    """The staleness of an experience consumed at ``trainer_version``; raises when it exceeds ``max_staleness`` or
    comes from the future (a version the trainer has not made)."""
    staleness = trainer_version - experience_version
    if staleness < 0:
        raise StaleExperienceError(f"experience of policy version {experience_version} reached the trainer at "
                                   f"version {trainer_version}: the rollout side holds weights the trainer never made")
    if staleness > max_staleness:
        raise StaleExperienceError(f"experience of policy version {experience_version} consumed at version "
                                   f"{trainer_version}: {staleness} versions old, more than "
                                   f"distributed.max_staleness={max_staleness}")
    return staleness


@dataclass
class ExperienceLedger:
    """Produced vs consumed experiences, keyed by (step, share): each is produced once and consumed once, with the
    same number of samples. ``check_step`` closes a step (a share produced but not consumed, or the reverse, is an
    error); ``check_all`` closes the run."""

    produced: dict[tuple[int, int], int] = field(default_factory=dict)  # (step, share) -> samples
    consumed: dict[tuple[int, int], int] = field(default_factory=dict)

    def produce(self, step: int, share: int, samples: int) -> None:
        key = (step, share)
        if key in self.produced:
            raise LedgerError(f"experience of step {step}, share {share} produced twice")
        self.produced[key] = int(samples)

    def consume(self, step: int, share: int, samples: int) -> None:
        key = (step, share)
        if key not in self.produced:
            raise LedgerError(f"experience of step {step}, share {share} consumed but never produced")
        if key in self.consumed:
            raise LedgerError(f"experience of step {step}, share {share} delivered twice")
        if self.produced[key] != samples:
            raise LedgerError(f"experience of step {step}, share {share}: {self.produced[key]} samples produced, "
                              f"{samples} consumed")
        self.consumed[key] = int(samples)

    def step_counts(self, step: int) -> tuple[int, int]:
        """(samples produced, samples consumed) of ``step``."""
        return (sum(n for (s, _), n in self.produced.items() if s == step),
                sum(n for (s, _), n in self.consumed.items() if s == step))

    def check_step(self, step: int, shares: int) -> dict[str, float]:
        """Every one of ``shares`` shares of ``step`` produced and consumed once; returns the step's counts."""
        have = sorted(sh for (s, sh) in self.consumed if s == step)
        if have != list(range(shares)):
            raise LedgerError(f"step {step}: consumed shares {have}, expected {list(range(shares))}")
        produced, consumed = self.step_counts(step)
        if produced != consumed:
            raise LedgerError(f"step {step}: {produced} samples produced, {consumed} consumed")
        return {"ledger/produced": float(produced), "ledger/consumed": float(consumed)}

    def check_all(self) -> tuple[int, int]:
        """At the end of a run: nothing produced and left unconsumed. Returns (produced, consumed) samples."""
        left = sorted(set(self.produced) - set(self.consumed))
        if left:
            raise LedgerError(f"experiences produced but never consumed (step, share): {left}")
        return sum(self.produced.values()), sum(self.consumed.values())


@dataclass
class StalenessStats:
    """Distribution of the staleness of consumed experiences (weighted by samples) over the run."""

    counts: Counter = field(default_factory=Counter)  # staleness -> samples

    def add(self, staleness: int, samples: int) -> None:
        self.counts[int(staleness)] += int(samples)

    def state_dict(self) -> dict[str, int]:
        """The histogram as JSON (a checkpoint's): it is the run's, so a resumed run goes on counting from it."""
        return {str(k): int(n) for k, n in sorted(self.counts.items())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.counts = Counter({int(k): int(n) for k, n in state.items()})

    def metrics(self, step_values: list[int]) -> dict[str, float]:
        """``async/staleness_*`` of this step's experiences plus the run's histogram (``async/staleness_count_<k>``,
        samples)."""
        out = {"async/staleness_mean": sum(step_values) / len(step_values) if step_values else 0.0,
               "async/staleness_max": float(max(step_values, default=0))}
        out.update({f"async/staleness_count_{k}": float(n) for k, n in sorted(self.counts.items())})
        return out


@dataclass
class WaitShares:
    """The trainer's waits for experiences and the rollout actors' idle time between batches, each step's and their
    shares of the wall time since the pipeline started (what tells whether ``max_staleness`` hides the generation)."""

    start: float = field(default_factory=time.perf_counter)
    trainer: float = 0.0
    rollout: float = 0.0

    def add(self, trainer_wait: float, rollout_wait: float) -> dict[str, float]:
        self.trainer += trainer_wait
        self.rollout += rollout_wait
        wall = time.perf_counter() - self.start
        return {"async/trainer_wait_s": trainer_wait, "async/rollout_wait_s": rollout_wait,
                "async/trainer_wait_share": self.trainer / wall, "async/rollout_wait_share": self.rollout / wall,
                "time/wall": wall}
