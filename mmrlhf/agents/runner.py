"""Running tool calls (and environment steps) concurrently, each under its own deadline.

Why: in a batch of trajectories every observation waits for the slowest call, and one hung call (a network tool
without a timeout) must not block the others or the step. So every call runs off the caller's thread:

- plain tools in a pool of ``workers`` daemon threads; async tools (``async def __call__``) on one event loop
  running in its own daemon thread. Async tools must await, never block: a blocking one stalls every async call
  (the stalled calls time out, and later async calls get a fresh loop);
- each call's deadline is ``timeout_s`` from the moment it starts running (a call queued behind busy workers, or
  behind its tool's ``max_concurrency`` calls already running, is not charged for the wait). Past it the call is
  answered with a ``timeout`` error. An async call is cancelled; a thread cannot be stopped, so a late plain call is
  ABANDONED: its thread keeps running until the call returns (its result is then dropped) and a replacement thread
  is started at once, so the pool keeps ``workers`` threads available (and the call no longer counts against its
  tool's ``max_concurrency``). A batch of n calls thus takes at most about ``ceil(n / workers) * timeout_s``;
- the threads are daemons (a hung call never blocks the interpreter's exit; the standard ThreadPoolExecutor joins
  its threads at exit, which is why it is not used here);
- an exception becomes a ``tool_raised`` answer naming the tool and the exception (the traceback is logged at
  WARNING via :mod:`logging`); an image over ``max_image_pixels`` (width x height) an ``image_too_large`` one, a
  text over ``max_text_chars`` characters a ``text_too_long`` one (refused as a whole, as an oversize image: a cut
  text could end inside a number or a sentence and the model could not tell; checked before any tokenising);
- *any* exception a call raises is the call's failure, ``BaseException`` included: a tool's ``sys.exit``,
  ``KeyboardInterrupt``, ``GeneratorExit`` or its own ``BaseException`` subclass never ends the rollout. This is
  safe for a real Ctrl-C: Python runs signal handlers, so raises a user's ``KeyboardInterrupt``, in the main
  thread only, and tools run in worker threads or on the event loop's thread, never in the main thread; the
  main thread waits for the calls and a Ctrl-C there (or the trainer's stop handler,
  :mod:`mmrlhf.trainer.interrupt`) acts as always. On the event loop, the cancellation the runner itself sends at a
  deadline stays a cancellation (a ``timeout``); a ``CancelledError`` the tool raises on its own is its failure.

Results come back in job order with the seconds each call ran. Calls of one trajectory share its ToolContext
(``state`` included) and may run at the same time: tools that write ``state`` guard it themselves. The runner may
be called from several threads at once (the asynchronous rollout runs each trajectory's calls as their own batch):
its workers, its event loop and each tool's ``max_concurrency`` are shared by all of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import inspect
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from mmrlhf.agents.environment import Environment
from mmrlhf.agents.runner_pool import Bounds, DaemonPool, Gate
from mmrlhf.agents.tool_base import Tool, as_result, is_async_tool
from mmrlhf.agents.types import FailedStep, StepResult, ToolCall, ToolContext, ToolResult
from mmrlhf.config.agent import AgentConfig

logger = logging.getLogger(__name__)

_POLL_S = 0.01  # how often the waiter looks at calls still queued (those have no deadline yet)
_MAX_MESSAGE = 500


@dataclass
class _Failure:
    kind: str
    text: str


@dataclass
class _Job:
    """One call: ``call()`` returns the value (or, for an async job, the coroutine); ``finish`` turns the value
    into the outcome (a result, or a _Failure); ``started`` / ``ended`` are monotonic seconds set by the worker."""

    label: str
    call: Callable[[], Any]
    is_async: bool
    finish: Callable[[Any], Any]
    bound: tuple[str, int] | None = None  # (tool name, its max_concurrency): at most that many of its calls run
    submitted: float | None = None
    started: float | None = None
    ended: float | None = None


def _short(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _nothing() -> None:
    return None


def _nothing_of(value: Any) -> None:
    return None


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """Run the tools' event loop until it is stopped. asyncio re-raises a task's KeyboardInterrupt or SystemExit
    out of the loop itself; a call's own are caught in the call, but a task a tool started and left running may
    still raise one: it is logged and the loop serves on (else every later async call would wait for its deadline
    on a dead loop)."""
    while True:
        try:
            loop.run_forever()
            return
        except BaseException as exc:  # this is the loop's own daemon thread: a user's Ctrl-C never arrives here
            logger.warning("a task an async tool started raised %s; the tool event loop goes on", type(exc).__name__,
                           exc_info=exc)


async def _cancel_tasks() -> None:
    """Cancel every other task of the running loop and give them a moment to unwind."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=1.0)


class ToolRunner:
    """Runs batches of tool calls / environment steps concurrently under a per-call deadline (module docstring).

    ``tools``: the configured tools by name; ``workers``: threads for plain tools; ``timeout_s``: each call's
    deadline; ``max_image_pixels``: the largest image (width x height) a call may return; ``max_text_chars``: the
    longest text (characters) a call may return."""

    def __init__(self, tools: Mapping[str, Tool], *, workers: int, timeout_s: float, max_image_pixels: int,
                 max_text_chars: int = 32_768) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(max_image_pixels, int) or max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be a positive int, got {max_image_pixels!r}")
        if not isinstance(max_text_chars, int) or max_text_chars < 1:
            raise ValueError(f"max_text_chars must be a positive int, got {max_text_chars!r}")
        self.tools = dict(tools)
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.max_image_pixels = max_image_pixels
        self.max_text_chars = max_text_chars
        self._pool = DaemonPool(workers, "mmrlhf-tool")
        self._bounds = Bounds()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, tools: Mapping[str, Tool], config: AgentConfig) -> "ToolRunner":
        """A runner with ``agent.tool_workers``, ``agent.tool_timeout_s``, ``agent.max_image_pixels`` and
        ``agent.max_text_chars``."""
        return cls(tools, workers=config.tool_workers, timeout_s=config.tool_timeout_s,
                   max_image_pixels=config.max_image_pixels, max_text_chars=config.max_text_chars)

    # ------------------------------------------------------------------------------------------------- public

    def run(self, jobs: Sequence[tuple[ToolCall, ToolContext]]) -> list[tuple[ToolResult, float]]:
        """Each ``(call, context)`` answered, in job order, with the seconds the call ran (0 for an unknown
        tool, about ``timeout_s`` for a timeout). Arguments are passed as a copy (the call record stays as
        parsed)."""
        work: list[_Job | _Failure] = []
        for call, context in jobs:
            tool = self.tools.get(call.name)
            if tool is None:
                known = ", ".join(self.tools) or "none"
                work.append(_Failure("unknown_tool", f"Error: unknown tool {call.name!r}. Available tools: {known}."))
                continue
            bound = getattr(tool, "max_concurrency", None)
            work.append(_Job(
                label=call.name,
                call=self._bind(tool, copy.deepcopy(call.arguments), context),
                is_async=is_async_tool(tool),
                finish=self._tool_finisher(call.name),
                bound=None if bound is None else (call.name, int(bound)),
            ))
        return [(self._as_tool_result(outcome), seconds) for outcome, seconds in self._run(work)]

    def run_environment_steps(self, envs: Sequence[Environment], actions: Sequence[str]
                              ) -> list[tuple[StepResult, float]]:
        """``envs[i].step(actions[i])`` for all i, concurrently; a step that raises, times out, returns something
        other than a StepResult or an oversize image ends its episode: ``FailedStep(observation=ToolResult(
        error=<kind>, text=...))`` (``done``; the environment is then closed, never reused)."""
        if len(envs) != len(actions):
            raise ValueError(f"{len(envs)} environments but {len(actions)} actions")
        work: list[_Job | _Failure] = [
            _Job(label=f"environment {type(env).__name__}.step", call=self._bind_method(env.step, action),
                 is_async=inspect.iscoroutinefunction(env.step), finish=self._step_finisher(type(env).__name__))
            for env, action in zip(envs, actions)
        ]
        return [(self._as_step_result(outcome), seconds) for outcome, seconds in self._run(work)]

    def run_environment_resets(self, envs: Sequence[Environment], records: Sequence[dict[str, Any]]
                               ) -> list[tuple[StepResult | None, float]]:
        """``envs[i].reset(records[i])`` for all i, under the same rules: None where reset gave no observation,
        ``StepResult(observation, done=False)`` where it gave one (a StepResult it returned is kept as it is, its
        ``done`` and ``info`` included), ``FailedStep(error observation)`` where it failed (the episode cannot
        start)."""
        if len(envs) != len(records):
            raise ValueError(f"{len(envs)} environments but {len(records)} records")
        work: list[_Job | _Failure] = [
            _Job(label=f"environment {type(env).__name__}.reset", call=self._bind_method(env.reset, record),
                 is_async=inspect.iscoroutinefunction(env.reset), finish=self._reset_finisher(type(env).__name__))
            for env, record in zip(envs, records)
        ]
        return [(None if outcome is None else self._as_step_result(outcome), seconds)
                for outcome, seconds in self._run(work)]

    def run_environment_closes(self, envs: Sequence[Environment]) -> list[tuple[ToolResult | None, float]]:
        """``envs[i].close()`` (where there is one; it may be ``async def``) for all i, under the same rules: None
        where it closed, an error ``ToolResult`` (``tool_raised``, ``timeout``) where it failed."""
        closers = [getattr(env, "close", None) for env in envs]
        work: list[_Job | _Failure] = [
            _Job(label=f"environment {type(env).__name__}.close", call=close if callable(close) else _nothing,
                 is_async=inspect.iscoroutinefunction(close), finish=_nothing_of)
            for env, close in zip(envs, closers)
        ]
        return [(None if outcome is None else self._as_tool_result(outcome), seconds)
                for outcome, seconds in self._run(work)]

    def close(self) -> None:
        """Stop the worker threads and the event loop (abandoned calls keep their threads until they return)."""
        if self._closed:
            return
        self._closed = True
        self._pool.close(self.workers)
        with self._loop_lock:
            loop, thread = self._loop, self._loop_thread
        if loop is not None and thread is not None:
            # cancel what still runs (a timed-out call's cancellation may still be on its way), then stop
            try:
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(timeout=2.0)
            except concurrent.futures.TimeoutError:
                logger.warning("the tool event loop did not answer within 2 s at close (an async tool blocks it); "
                               "its daemon thread is left behind")
                return
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=2.0)
            if not thread.is_alive():
                loop.close()

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------- finishing

    def _check_result(self, result: ToolResult, label: str) -> ToolResult | _Failure:
        if len(result.text) > self.max_text_chars:
            was = f" (its error: {result.error})" if result.error else ""
            return _Failure("text_too_long", f"Error: {label} returned {len(result.text)} characters of text{was}, "
                                             f"over the limit of {self.max_text_chars}.")
        for image in result.images:
            pixels = image.width * image.height
            if pixels > self.max_image_pixels:
                return _Failure("image_too_large", f"Error: {label} returned a {image.width}x{image.height} image "
                                                   f"({pixels} pixels), over the limit of {self.max_image_pixels}.")
        return result

    def _tool_finisher(self, name: str) -> Callable[[Any], ToolResult | _Failure]:
        return lambda value: self._check_result(as_result(value, name), name)

    def _step_finisher(self, env_name: str) -> Callable[[Any], StepResult | _Failure]:
        def finish(value: Any) -> StepResult | _Failure:
            if not isinstance(value, StepResult):
                raise TypeError(f"environment {env_name}.step returned a {type(value).__name__}, not a StepResult")
            observation = self._check_result(as_result(value.observation, f"{env_name}.step"), env_name)
            if isinstance(observation, _Failure):
                return observation
            return StepResult(observation=observation, done=value.done, info=value.info)

        return finish

    def _reset_finisher(self, env_name: str) -> Callable[[Any], StepResult | _Failure | None]:
        def finish(value: Any) -> StepResult | _Failure | None:
            if value is None:
                return None
            given = value if isinstance(value, StepResult) else StepResult(observation=value)
            observation = self._check_result(as_result(given.observation, f"{env_name}.reset"), env_name)
            return observation if isinstance(observation, _Failure) else dataclasses.replace(given,
                                                                                            observation=observation)

        return finish

    @staticmethod
    def _as_tool_result(outcome: Any) -> ToolResult:
        return ToolResult(text=outcome.text, error=outcome.kind) if isinstance(outcome, _Failure) else outcome

    @staticmethod
    def _as_step_result(outcome: Any) -> StepResult:
        if isinstance(outcome, _Failure):
            return FailedStep(observation=ToolResult(text=outcome.text, error=outcome.kind))
        return outcome

    # ------------------------------------------------------------------------------------------------ running

    @staticmethod
    def _bind(tool: Tool, arguments: dict[str, Any], context: ToolContext) -> Callable[[], Any]:
        return lambda: tool(arguments, context)

    @staticmethod
    def _bind_method(method: Callable[[Any], Any], argument: Any) -> Callable[[], Any]:
        return lambda: method(argument)

    def _raised(self, job: _Job, exc: BaseException) -> _Failure:
        logger.warning("%s raised %s", job.label, type(exc).__name__, exc_info=exc)
        detail = str(exc)
        return _Failure("tool_raised", _short(f"Error: {job.label} raised {type(exc).__name__}"
                                              + (f": {detail}" if detail else ".")))

    def _execute(self, job: _Job) -> Any:
        """A plain job, in a worker thread: its outcome, never an exception."""
        job.started = time.monotonic()
        try:
            value = job.call()
            if inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                raise TypeError("a plain __call__ returned an awaitable; declare it 'async def'")
            return job.finish(value)
        except BaseException as exc:  # a worker thread: a user's Ctrl-C never lands here (module docstring)
            return self._raised(job, exc)
        finally:
            job.ended = time.monotonic()

    async def _execute_async(self, job: _Job) -> Any:
        """An async job, on the event loop: its outcome, never an exception (cancellation aside)."""
        job.started = time.monotonic()
        try:
            return job.finish(await job.call())
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the runner's own cancellation (a deadline, closing)
                raise
            return self._raised(job, exc)
        except BaseException as exc:  # the loop's thread: a user's Ctrl-C never lands here (module docstring)
            return self._raised(job, exc)
        finally:
            job.ended = time.monotonic()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_serve, args=(loop,), name="mmrlhf-tool-loop", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def _submit(self, job: _Job) -> concurrent.futures.Future:
        job.submitted = time.monotonic()
        if job.is_async:
            return asyncio.run_coroutine_threadsafe(self._execute_async(job), self._event_loop())
        return self._pool.submit(lambda: self._execute(job))

    def _run(self, work: list[_Job | _Failure]) -> list[tuple[Any, float]]:
        """Outcomes in order with their seconds; waits until each job finished or passed its deadline."""
        if self._closed:
            raise RuntimeError("the tool runner is closed")
        out: list[tuple[Any, float]] = [(item, 0.0) for item in work]
        gate = Gate([i for i, item in enumerate(work) if isinstance(item, _Job)], work, self._bounds)
        pending = {self._submit(work[i]): i for i in gate.admit()}
        while pending or gate.waiting:  # waiting: calls of a tool whose max_concurrency other batches now hold
            now = time.monotonic()
            deadlines = []
            for future, i in list(pending.items()):
                job = work[i]
                assert isinstance(job, _Job)
                if future.done():
                    del pending[future]
                    out[i] = self._collect(future, job)
                elif job.started is not None and now >= job.started + self.timeout_s:
                    del pending[future]
                    out[i] = self._time_out(future, job, now)
                elif job.is_async and job.submitted is not None and now >= job.submitted + self.timeout_s:
                    del pending[future]  # an async call starts at once unless an async tool blocks the loop
                    out[i] = self._loop_blocked(future, job)
                elif job.started is not None:
                    deadlines.append(job.started + self.timeout_s)
                if future not in pending:  # answered (or given up on): its tool's next queued call may start
                    gate.leave(job)
            pending.update({self._submit(work[i]): i for i in gate.admit()})
            if not pending:
                if gate.waiting:
                    time.sleep(_POLL_S)
                continue
            # every running call has a deadline; a queued one is looked at again soon (it may start any time)
            wait = min(deadlines) - now if len(deadlines) == len(pending) else _POLL_S
            concurrent.futures.wait(list(pending), timeout=max(min(wait, self.timeout_s), 0.0),
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return out

    def _collect(self, future: concurrent.futures.Future, job: _Job) -> tuple[Any, float]:
        seconds = (job.ended or time.monotonic()) - (job.started or time.monotonic())
        if future.cancelled():
            return _Failure("timeout", f"Error: {job.label} was cancelled."), seconds
        exc = future.exception()
        if exc is not None:  # _execute / _execute_async report failures as outcomes; this is a runner bug
            raise RuntimeError(f"the tool runner failed running {job.label}") from exc
        return future.result(), seconds

    def _loop_blocked(self, future: concurrent.futures.Future, job: _Job) -> tuple[_Failure, float]:
        """An async call that never started: an async tool is blocking the event loop. Later async calls get a new
        loop (the blocked one's thread is abandoned, like a stuck worker)."""
        future.cancel()
        with self._loop_lock:
            blocked, self._loop, self._loop_thread = self._loop, None, None
        if blocked is not None:
            logger.warning("%s could not start within %.2f s: an async tool is blocking the event loop (it must "
                           "await, not block); later async calls use a new loop", job.label, self.timeout_s)
        return _Failure("timeout", f"Error: {job.label} did not answer within {self.timeout_s:g} s."), 0.0

    def _time_out(self, future: concurrent.futures.Future, job: _Job, now: float) -> tuple[_Failure, float]:
        seconds = now - (job.started or now)
        if job.is_async:
            future.cancel()
            logger.warning("%s timed out after %.2f s; cancelled", job.label, seconds)
        else:
            stuck = self._pool.abandon(future)
            logger.warning("%s timed out after %.2f s; its thread is abandoned (%d abandoned calls still running)",
                           job.label, seconds, stuck)
        return _Failure("timeout", f"Error: {job.label} did not answer within {self.timeout_s:g} s."), seconds
