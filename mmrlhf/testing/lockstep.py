"""Several ranks in one process, for tests and benchmarks of code that calls :class:`~mmrlhf.parallel.world.World`
collectives: each rank runs in its own thread, and every collective waits for all of them (a barrier), so a rank
that calls fewer collectives, or others, than its peers hangs the others as it would under torchrun, and is
reported here as an error after ``timeout`` seconds instead of a hung test. No process group, no model sharding:
numbers and objects only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mmrlhf.parallel.world import World


class _Shared:
    def __init__(self, size: int, timeout: float) -> None:
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size
        self.calls: list[list[str]] = [[] for _ in range(size)]  # per rank, the collectives it called, in order


@dataclass(frozen=True)
class LockstepWorld(World):
    """A rank of a world whose collectives are threads meeting at a barrier."""

    shared: Any = field(default=None, compare=False, repr=False)

    def _exchange(self, name: str, value: Any) -> list[Any]:
        s = self.shared
        s.calls[self.rank].append(name)
        s.slots[self.rank] = (name, value)
        s.barrier.wait()
        got = list(s.slots)
        s.barrier.wait()  # nobody writes the next round before everyone has read this one
        names = {n for n, _ in got}
        if len(names) != 1:
            raise RuntimeError(f"ranks called different collectives at once: {sorted(names)}")
        return [v for _, v in got]

    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        rows = self._exchange(f"reduce-{op}-{len(values)}", [float(v) for v in values])
        if len({len(r) for r in rows}) != 1:
            raise RuntimeError(f"ranks reduce vectors of different lengths: {[len(r) for r in rows]}")
        combine = sum if op == "SUM" else max
        return [float(combine(col)) for col in zip(*rows)]

    def broadcast_object(self, obj: Any) -> Any:
        return self._exchange("broadcast", obj)[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        return self._exchange("gather", obj)

    def barrier(self) -> None:
        self._exchange("barrier", None)


def run_ranks(fn: Callable[[LockstepWorld], Any], world_size: int, *, timeout: float = 60.0) -> list[Any]:
    """``fn(world)`` on ``world_size`` ranks at once; their results in rank order. An exception on any rank is
    raised here (the others then fail at their next collective: the barrier is broken)."""
    shared = _Shared(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(LockstepWorld(rank=rank, world_size=world_size, launch="torchrun", shared=shared))
        except BaseException as exc:  # reported below, in rank order
            errors[rank] = exc
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def collective_calls(world: LockstepWorld) -> list[str]:
    """The collectives rank ``world.rank`` has called so far, in order."""
    return list(world.shared.calls[world.rank])
