"""The rollout actors of one step as a world: the step-wide collectives of several Ray rollout actors.

Why: a step's prompts are split over the rollout actors, and some of what a step computes reads the WHOLE step: the
batch statistics of the shaping (advantage whitening, the REINFORCE baselines, CPGD's clip filter), the running
reward normalisation and the adaptive KL controller, and dynamic sampling's choice of the groups that fill the batch.
Torchrun ranks take those as collectives over their process group (:mod:`mmrlhf.experience.step_shaping`,
:class:`~mmrlhf.trainer.rollouts.LocalRollouts`); rollout actors have no process group (they come and go: a restarted
one joins a step in progress, and a group would have to be rebuilt around it). So the same collectives run through
one small Ray actor, :class:`StepExchange`: each rollout actor hands it its part of a step's collective and gets
every part back, in share order, once all have arrived. :class:`SharesWorld` is the
:class:`~mmrlhf.parallel.world.World` that does this, so the shaping and the sampling code read the same whether
their ranks are torchrun's or the rollout actors' shares, and every share ends up with the same step-wide numbers and
the same running state.

Every share calls the same collectives of a step in the same order (the same code on its share), so a call is named
by (step, its number within the step). A restarted actor that regenerates a step takes part again: a collective
every share already finished answers from what was kept (the others went on with it), the others wait for it. The
rollout actors generate their steps in order (:class:`~mmrlhf.launch.ray.holder.ExperienceMakerHolder`), so no
actor waits inside a step for one that is busy with a later one.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from mmrlhf.parallel.world import World

KEPT_STEPS = 32  # finished collectives kept for a restarted actor, in steps behind the newest one


class StepExchange:
    """The meeting point of ``count`` shares (wrapped with ``ray.remote``; asynchronous, so the waiting calls hold
    no thread)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a step exchange needs at least one share, got {count}")
        self.count = count
        self._rounds: dict[tuple[int, int], _Round] = {}
        self._newest = -1

    async def gather(self, step: int, call: int, share: int, part: Any) -> list[Any]:
        """Share ``share``'s ``part`` of collective ``call`` of step ``step``; every share's part, in share order,
        once all are here."""
        if not 0 <= share < self.count:
            raise ValueError(f"share {share} outside the {self.count} rollout actors")
        key = (int(step), int(call))
        round_ = self._rounds.get(key)
        if round_ is None:
            round_ = self._rounds[key] = _Round(asyncio.Event())
        if not round_.done.is_set():  # a finished one keeps the parts the others went on with
            round_.parts[share] = part
            if len(round_.parts) == self.count:
                round_.done.set()
        await round_.done.wait()
        self._forget(int(step))
        return [round_.parts[i] for i in range(self.count)]

    def pending(self) -> list[tuple[int, int, list[int]]]:
        """(step, call, the shares that arrived) of every unfinished collective (what a stuck run waits for)."""
        return [(s, c, sorted(r.parts)) for (s, c), r in sorted(self._rounds.items()) if not r.done.is_set()]

    def _forget(self, step: int) -> None:
        if step <= self._newest:
            return
        self._newest = step
        for key in [k for k, r in self._rounds.items() if k[0] < step - KEPT_STEPS and r.done.is_set()]:
            del self._rounds[key]


@dataclass
class _Round:
    done: asyncio.Event
    parts: dict[int, Any] = field(default_factory=dict)


def start_step_exchange(count: int) -> Any:
    """The run's exchange for ``count`` rollout actors (owned by the caller, the driver, which hands it to them; no
    CPU reserved: it only passes numbers)."""
    import ray

    return ray.remote(StepExchange).options(num_cpus=0, max_concurrency=1000).remote(count)


class RayExchange:
    """A :class:`StepExchange` actor called from a rollout actor (blocking)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def gather(self, step: int, call: int, share: int, part: Any) -> list[Any]:
        import ray

        return ray.get(self.handle.gather.remote(step, call, share, part))


@dataclass(frozen=True)
class SharesWorld(World):
    """Rollout actor ``rank`` of ``world_size`` at step ``step``: the world whose collectives are that step's over
    every rollout actor, through ``exchange`` (a :class:`RayExchange`: anything whose ``gather(step, call, share,
    part)`` returns every share's part). Made afresh for each step (its calls are numbered from 0). Its models are
    not sharded (every rollout actor holds whole copies): ``sharded`` is False."""

    exchange: Any = None
    step: int = 0
    calls: Any = field(default_factory=itertools.count)

    @property
    def sharded(self) -> bool:
        return False

    def _gather(self, part: Any) -> list[Any]:
        return self.exchange.gather(self.step, next(self.calls), self.rank, part)

    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        parts = self._gather([float(v) for v in values])
        if any(len(p) != len(values) for p in parts):
            raise RuntimeError(f"step {self.step}: the rollout actors' collective has parts of lengths "
                               f"{[len(p) for p in parts]} (the shares called different collectives)")
        combine = sum if op == "SUM" else max
        return [float(combine(column)) for column in zip(*parts)]  # in share order: the same on every share

    def gather_objects(self, obj: Any) -> list[Any]:
        return self._gather(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return self._gather(obj if self.is_main else None)[0]

    def scatter_objects(self, parts: Sequence[Any] | None) -> Any:
        if self.is_main and (parts is None or len(parts) != self.world_size):
            raise ValueError(f"scatter_objects: share 0 must give {self.world_size} parts")
        return self._gather(list(parts) if self.is_main else None)[0][self.rank]

    def barrier(self) -> None:
        self._gather(None)
