"""Where synchronous reward functions run, so they never hold up the event loop (remote requests, other sources).

- A plain function runs in a thread of a bounded pool (the engine's ``reward.function_workers`` pool, the server's
  ``--threads`` pool, or else a small pool shared by the process).
- A function marked :func:`main_thread` (math-verify guards sympy with ``signal.alarm``, which only works in the
  main thread) runs on the main thread. :meth:`RewardComputationEngine.compute` makes that possible without
  blocking the loop: called from the main thread, it runs the event loop in a helper thread and serves the marked
  functions on the main thread meanwhile (:class:`MainThreadRunner`). Where no runner is installed (``acompute``
  awaited from someone else's loop), a marked function runs on the loop's thread if that is the main thread
  (e.g. ``serve-reward``: safe, but it holds up other requests while it runs), else in the pool without its
  timeout (math-verify then warns).

Why not a thread for everything: a pathological expression (``10^{10^{10^{10}}}``) makes sympy compute a huge
integer in C while holding the GIL; only a signal handler in the main thread can interrupt that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import queue
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_FUNCTION_WORKERS = 4
"""Threads of the pool shared by function sources built without one (``reward.function_workers`` sizes the
engine's own pool)."""

MAIN_THREAD_ATTR = "__mmrlhf_main_thread__"

_shared_pool: "DaemonThreadPool | None" = None
_shared_pool_lock = threading.Lock()
_runner: contextvars.ContextVar["MainThreadRunner | None"] = contextvars.ContextVar("reward_main_runner", default=None)


def main_thread(fn: F) -> F:
    """Mark a synchronous reward function as needing the main thread (signal-based timeouts); see the module doc."""
    setattr(fn, MAIN_THREAD_ATTR, True)
    return fn


def shared_function_pool() -> "DaemonThreadPool":
    """The process-wide bounded pool for synchronous reward functions given no executor of their own."""
    global _shared_pool
    with _shared_pool_lock:
        if _shared_pool is None:
            _shared_pool = DaemonThreadPool(DEFAULT_FUNCTION_WORKERS, thread_name_prefix="reward-fn")
        return _shared_pool


class DaemonThreadPool(Executor):
    """A bounded thread pool whose workers never keep the process alive, and whose stuck workers can be replaced.

    Why not ``concurrent.futures.ThreadPoolExecutor``: at interpreter exit it joins its workers, so one reward
    function that never returns kept the process alive after Ctrl-C (and a pool with all workers stuck would serve
    nothing more). Here workers are daemon threads, and :meth:`replace_stuck` retires the workers whose current call
    has run longer than a deadline (a reward source's ``timeout_s``): each gets a fresh replacement, so the pool
    keeps ``max_workers`` usable threads, and the stuck thread ends on its own if its call ever returns. A Python
    thread cannot be killed; its call's result is simply never used."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "pool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._prefix, self._count = thread_name_prefix, 0
        self._started: dict[int, float | None] = {}  # worker id -> start time of its current call (None: idle)
        self._retired: set[int] = set()
        self._shutdown = False
        for _ in range(max_workers):
            self._spawn()

    def _spawn(self) -> None:
        self._count += 1
        wid = self._count
        self._started[wid] = None
        threading.Thread(target=self._work, args=(wid,), name=f"{self._prefix}-{wid}", daemon=True).start()

    def _work(self, wid: int) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._started[wid] = time.monotonic()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller, which re-raises it
                future.set_exception(exc)
            with self._lock:
                if wid in self._retired:  # replaced while stuck: a fresh worker already took its place
                    self._retired.discard(wid)
                    self._started.pop(wid, None)
                    return
                self._started[wid] = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        if self._shutdown:
            raise RuntimeError("cannot submit to a pool that was shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def replace_stuck(self, older_than_s: float) -> int:
        """Retire and replace every worker whose current call started more than ``older_than_s`` seconds ago;
        returns how many."""
        now = time.monotonic()
        with self._lock:
            stuck = [w for w, t in self._started.items()
                     if t is not None and w not in self._retired and now - t > older_than_s]
            for wid in stuck:
                self._retired.add(wid)
                self._spawn()
        return len(stuck)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:  # noqa: ARG002
        """Stop the idle workers (stuck ones end when their call returns); never waits for a running call."""
        self._shutdown = True
        with self._lock:
            live = len(self._started)
        for _ in range(live):
            self._queue.put(None)


class MainThreadRunner:
    """Runs submitted calls on the thread that calls :meth:`serve` (the main thread) until :meth:`close`."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((call, future))
        return future

    def close(self) -> None:
        self._calls.put(None)

    def serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            if not future.set_running_or_notify_cancel():  # its awaiter gave up before it started
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which re-raises it
                future.set_exception(exc)


STOP_GRACE_S = 2.0
"""How long an interrupted :func:`run_loop_serving_main_thread` waits for its loop to wind down before it re-raises."""


def run_loop_serving_main_thread(coro_factory: Callable[[], Any]) -> Any:
    """``asyncio.run(coro_factory())`` in a helper thread while this (main) thread serves :func:`main_thread` calls.

    The coroutine's exception is re-raised here as it is (no chained context). Interrupted (Ctrl-C reaches the main
    thread), the loop's task is cancelled and the loop thread given :data:`STOP_GRACE_S` to end before the interrupt
    propagates: left running, it could still be inside a C++ call (a torch op) when the interpreter tears its
    libraries down, which aborted the process ("terminate called without an active exception", seen when Ctrl-C
    came within milliseconds of a reward computation's start). A reward function stuck in its own thread is not
    waited for (daemon threads, see :class:`DaemonThreadPool`).
    """
    runner = MainThreadRunner()
    outcome: dict[str, Any] = {}
    stop, alive = threading.Event(), threading.Event()
    running: dict[str, Any] = {}  # the loop and its main task, once they exist

    async def main() -> Any:
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        if stop.is_set():  # interrupted before the task existed (checked after registering it: no gap)
            raise asyncio.CancelledError
        return await coro_factory()

    def loop_thread() -> None:
        alive.set()  # (an interrupt inside thread.start() may come before threading counts it as started)
        _runner.set(runner)  # this thread's context: every task of the loop inherits it
        try:
            outcome["value"] = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            outcome["error"] = exc
        finally:
            runner.close()

    thread = threading.Thread(target=loop_thread, name="reward-loop", daemon=True)
    try:
        thread.start()  # (waits for the thread to start: interruptible too)
        runner.serve()
    except BaseException:
        stop.set()
        if "task" in running:
            _cancel_soon(running["loop"], running["task"])
        if alive.wait(STOP_GRACE_S):
            thread.join(STOP_GRACE_S)
        raise
    thread.join()
    if "error" in outcome:
        error = outcome.pop("error")
        raise error
    return outcome["value"]


def _cancel_soon(loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
    """Cancel ``task`` from another thread, unless its loop has already closed (then it has ended anyway)."""
    try:
        loop.call_soon_threadsafe(task.cancel)
    except RuntimeError:  # "Event loop is closed": the run finished between the check and the call
        if not loop.is_closed():
            raise


async def run_sync(call: Callable[[], Any], *, needs_main_thread: bool, executor: Executor | None) -> Any:
    """Run ``call`` off the event loop: see the module docstring for which thread."""
    if needs_main_thread:
        runner = _runner.get()
        if runner is not None:
            return await asyncio.wrap_future(runner.submit(functools.partial(contextvars.copy_context().run, call)))
        if threading.current_thread() is threading.main_thread():
            return call()
    loop = asyncio.get_running_loop()
    # With the caller's context variables, as asyncio.to_thread would.
    return await loop.run_in_executor(executor or shared_function_pool(), contextvars.copy_context().run, call)
