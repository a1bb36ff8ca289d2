"""The tool runner's thread machinery (:mod:`mmrlhf.agents.runner`): a pool of daemon workers whose stuck workers
can be replaced, and the gate that holds each tool's ``max_concurrency`` over every batch of calls."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable, Sequence


class DaemonPool:
    """A fixed pool of daemon worker threads whose stuck workers can be replaced (:meth:`abandon`)."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned: set[concurrent.futures.Future] = set()
        self._name = name
        self._spawned = 0
        self._closed = False
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        self._spawned += 1
        threading.Thread(target=self._work, name=f"{self._name}-{self._spawned}", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # fn reports its own failures; this keeps the worker alive regardless
                future.set_exception(exc)
            with self._lock:
                if future in self._abandoned:  # a replacement took this thread's place: leave
                    self._abandoned.discard(future)
                    return

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool runner is closed")
            self._queue.put((future, fn))
        return future

    def abandon(self, future: concurrent.futures.Future) -> int:
        """Give up on a running ``future``: start a replacement worker; its thread leaves once the call returns.
        Returns how many abandoned calls are still running."""
        with self._lock:
            if not future.done() and not self._closed:
                self._abandoned.add(future)
                self._spawn()
            return len(self._abandoned)

    def close(self, workers: int) -> None:
        with self._lock:
            self._closed = True
        for _ in range(workers):
            self._queue.put(None)


class Bounds:
    """How many calls of each bounded tool run now, over every batch of the runner (an asynchronous rollout runs
    many batches at once, one per trajectory): a tool's ``max_concurrency`` holds across them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    def take(self, name: str, limit: int) -> bool:
        with self._lock:
            if self._running.get(name, 0) >= limit:
                return False
            self._running[name] = self._running.get(name, 0) + 1
            return True

    def give(self, name: str) -> None:
        with self._lock:
            self._running[name] -= 1


class Gate:
    """Which of a batch's jobs may be submitted now: every job of a tool without a bound; of a bounded tool
    (a job's ``bound``), while fewer than its ``max_concurrency`` calls run (this batch's and others', :class:`Bounds`),
    in job order. A call the runner gave up on (its deadline passed) leaves the gate: a hung call cannot keep its
    tool's later calls from ever starting."""

    def __init__(self, order: list[int], work: Sequence[Any], bounds: Bounds) -> None:
        self._queued = list(order)
        self._work = work
        self._bounds = bounds

    def admit(self) -> list[int]:
        """The queued jobs that may start now (their tools' counts taken), in job order."""
        ready, left = [], []
        for i in self._queued:
            bound = self._work[i].bound
            if bound is None or self._bounds.take(*bound):
                ready.append(i)
            else:
                left.append(i)
        self._queued = left
        return ready

    @property
    def waiting(self) -> bool:
        """Whether a job is still queued behind its tool's bound."""
        return bool(self._queued)

    def leave(self, job: Any) -> None:
        if job.bound is not None:
            self._bounds.give(job.bound[0])
