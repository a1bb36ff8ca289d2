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
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_FUNCTION_WORKERS = 4
"""Threads of the pool shared by function sources built without one (``reward.function_workers`` sizes the
engine's own pool)."""

MAIN_THREAD_ATTR = "__mmrlhf_main_thread__"

_shared_pool: ThreadPoolExecutor | None = None
_shared_pool_lock = threading.Lock()
_runner: contextvars.ContextVar["MainThreadRunner | None"] = contextvars.ContextVar("reward_main_runner", default=None)


def main_thread(fn: F) -> F:
    """Mark a synchronous reward function as needing the main thread (signal-based timeouts); see the module doc."""
    setattr(fn, MAIN_THREAD_ATTR, True)
    return fn


def shared_function_pool() -> ThreadPoolExecutor:
    """The process-wide bounded pool for synchronous reward functions given no executor of their own."""
    global _shared_pool
    with _shared_pool_lock:
        if _shared_pool is None:
            _shared_pool = ThreadPoolExecutor(DEFAULT_FUNCTION_WORKERS, thread_name_prefix="reward-fn")
        return _shared_pool


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


def run_loop_serving_main_thread(coro_factory: Callable[[], Any]) -> Any:
    """``asyncio.run(coro_factory())`` in a helper thread while this (main) thread serves :func:`main_thread` calls.

    The coroutine's exception is re-raised here as it is (no chained context).
    """
    runner = MainThreadRunner()
    outcome: dict[str, Any] = {}

    def loop_thread() -> None:
        _runner.set(runner)  # this thread's context: every task of the loop inherits it
        try:
            outcome["value"] = asyncio.run(coro_factory())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            outcome["error"] = exc
        finally:
            runner.close()

    thread = threading.Thread(target=loop_thread, name="reward-loop", daemon=True)
    thread.start()
    runner.serve()
    thread.join()
    if "error" in outcome:
        error = outcome.pop("error")
        raise error
    return outcome["value"]


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
