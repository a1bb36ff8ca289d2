"""The asynchronous turn loop (``agent.loop: async``, the default): every trajectory runs on its own.

A trajectory's next turn goes to the engine the moment its observation is ready; its tool calls (or its
environment's step) start the moment its turn ends; the engine (:func:`~mmrlhf.rollout.streaming.open_stream`)
keeps a continuous batch of whichever trajectories are generating. So one slow tool call holds one trajectory,
not the step, and the engine generates while tools run.

How it stays exact: each turn draws from its own trajectory's seed with its own token cap (the same as the lockstep
loop's, :mod:`mmrlhf.agents.lockstep`), so the trajectories do not depend on timing or on which requests shared an
engine step; tests hold the two loops to the same ids, masks, log-probs and images.

Sessions form a pool: at most ``agent.max_concurrent_trajectories`` trajectories are alive (whole groups, a new
group admitted as soon as there is room for it, not when a wave ends). An environment that declares itself
``reusable`` goes back to the pool when its trajectory ends and is ``reset`` for the next one, if it is clean; any
other is closed, and its slot freed once the close returned, so a backend never holds more sessions than the
bound. Clean means its last ``reset`` and ``step`` answered: one that raised, timed out (its call may still run in
an abandoned thread) or returned what the runner refused is closed, never handed to the next trajectory, whose
record it might still be playing the previous episode of. It is closed at once, not after its abandoned call (which
may never return): the close runs beside that call, under the deadline. Whatever the step holds when it ends,
normally or by an exception, is closed (:class:`~mmrlhf.agents.sessions.Sessions`).

Turns that become ready together go to the engine together: after each engine step the loop gives the calls that
just started ``agent.gather_window_s`` to answer before it steps again (while recent calls answer within it; see
:meth:`AsyncTurns._gather` for why), so a group's quick calls make their turns ready at once and those are
prefilled in one engine step.

The main thread drives the engine and does every piece of bookkeeping; tool calls, environment steps, resets and
closes run in observer threads (each through the :class:`~mmrlhf.agents.runner.ToolRunner`, which bounds them by
its deadline, its workers and each tool's ``max_concurrency``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import statistics
import time
from typing import Any, Sequence

from mmrlhf.agents.live import LiveTrajectory
from mmrlhf.agents.loop_types import LoopStats
from mmrlhf.agents.sessions import Sessions, count_close_failures
from mmrlhf.agents.types import ToolContext
from mmrlhf.rollout.streaming import Finished, open_stream
from mmrlhf.rollout.types import SamplingSettings

logger = logging.getLogger(__name__)

_RECENT = 16  # calls whose seconds decide whether gathering pays (_gather)
_WARM = 4  # gathering runs until this many calls answered


def reusable(env: Any) -> bool:
    """Whether an environment may serve another trajectory after ``reset`` (its class says ``reusable = True``)."""
    return getattr(env, "reusable", False) is True


class AsyncTurns:
    """One step's trajectories, each on its own (module docstring)."""

    def __init__(self, loop: Any, sampling: SamplingSettings, stats: LoopStats, seconds: dict[str, float],
                 start: float) -> None:
        self.loop, self.sampling, self.stats, self.seconds, self.start = loop, sampling, stats, seconds, start
        self.stream = open_stream(loop.engine)
        self.keys = itertools.count()
        self.sent: dict[int, tuple[str, Any]] = {}  # stream key -> ("group", trajectories) | ("turn", trajectory)
        self.ready: list[tuple[str, Any]] = []  # turns to send
        self.window = loop.limits.gather_window_s  # agent.gather_window_s (_gather)
        self.latencies: collections.deque[float] = collections.deque(maxlen=_RECENT)  # the last calls' seconds
        self.pending: dict[concurrent.futures.Future, tuple[str, Any, Any, float]] = {}  # observer work in flight
        self.resetting: dict[int, int] = {}  # group -> resets still running
        self.free_envs: list[Any] = []  # reusable, clean environments between trajectories
        self.sessions = Sessions(loop.runner, stats)  # every environment not yet handed to a close
        self.skipped: dict[int, str] = {}
        self.live = 0  # trajectories (with their environment sessions) holding a slot

    def run(self, batch: Any, n: int, contexts: Sequence[ToolContext]) -> tuple[list[LiveTrajectory], dict[int, str]]:
        """Every trajectory of the step (in sample order) and the groups the engine skipped (group -> reason)."""
        limit = self.loop.limits.max_concurrent_trajectories
        size = len(batch)
        room = size if limit is None else max(1, limit // n) * n
        waiting = collections.deque(range(0, size, n))
        everyone: list[LiveTrajectory] = []
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(room, size)),
                                                              thread_name_prefix="mmrlhf-observe")
        done = False
        try:
            while True:
                while waiting and self.live + n <= max(room, n):
                    everyone += self._admit(batch, waiting.popleft(), n, contexts)
                for item in self.ready:
                    self._send(item, n)
                self.ready = []
                if self.stream.busy:
                    t0 = time.perf_counter()
                    finished = self.stream.step()
                    self.seconds["generate"] += time.perf_counter() - t0
                    for f in finished:
                        self._turn_done(f)
                elif self.pending:  # nothing to generate: the engine waits for an observation
                    t0 = time.perf_counter()
                    concurrent.futures.wait(list(self.pending), return_when=concurrent.futures.FIRST_COMPLETED)
                    self.seconds["tools"] += time.perf_counter() - t0
                elif not self.ready:
                    if waiting:  # nothing runs, yet no room: a slot was never given back
                        raise RuntimeError(f"agent loop: {self.live} trajectory slots held with nothing running")
                    break
                for future in [f for f in self.pending if f.done()]:
                    self._observed(future)
                self._gather()  # the calls just started: a moment for them to answer, before the next step
            self.free_envs = []
            self.seconds["tools"] += self.sessions.close_all(failing=False)  # the pool's (nothing else is held)
            done = True
        finally:
            self.stream.close()
            if not done:
                self._close_after_failure()
            self.executor.shutdown(wait=done, cancel_futures=not done)
        return sorted(everyone, key=lambda t: t.sample_index), self.skipped

    def _close_after_failure(self) -> None:
        """The step is raising: close every environment it holds (live, pooled, and those whose close was queued
        but never started), so no session outlives the step. Calls still running in observer threads are not
        waited for (their environments are closed beside them, as an abandoned call's)."""
        for future, (kind, _, env, _) in list(self.pending.items()):
            if kind == "close" and future.cancel():  # queued, never to run: closed here instead
                self.sessions.opened(env)
        self.free_envs = []
        self.sessions.close_all(failing=True)

    # ---- gathering ----------------------------------------------------------------------------------------------
    def _gather(self) -> None:
        """Before the engine's next step, wait for the observations that started less than ``agent.gather_window_s``
        ago (each at most that long from its own start), while the last calls have been answering within it.

        Why: where tools answer in a millisecond (the agent toy), the loop would step the engine while they run
        beside it, the tools' threads and the engine's thread taking the cores and the interpreter from each other,
        and each observation would come back on its own, so an engine step would prefill one or two turns. Waiting
        those few milliseconds lets the tools run while the engine waits, and the turns they make ready reach the
        engine together. Where calls take longer than the window (the median of the last ones), waiting would only
        hold the engine back: the loop does not wait then. Measured gains are small (``agent.gather_window_s``'s
        docstring: a few % on the agent toy, within the bench's noise). Trajectories are the same either way (each
        turn draws from its own seed)."""
        if self.window <= 0:
            return
        if len(self.latencies) >= _WARM and statistics.median(self.latencies) > self.window:
            return
        t0 = time.perf_counter()
        while True:
            now = time.perf_counter()
            fresh = [f for f, (kind, _, _, since) in self.pending.items()
                     if kind != "close" and now - since < self.window]
            if not fresh:
                break
            oldest = min(self.pending[f][3] for f in fresh)
            done, _ = concurrent.futures.wait(fresh, timeout=max(0.0, oldest + self.window - now),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                self._observed(future)
        self.seconds["tools"] += time.perf_counter() - t0

    # ---- admission and sending -------------------------------------------------------------------------------
    def _admit(self, batch: Any, first: int, n: int, contexts: Sequence[ToolContext]) -> list[LiveTrajectory]:
        """Start the group of samples ``first .. first + n - 1``: its environments reset (off this thread), or its
        shared first turn queued."""
        loop = self.loop
        group = []
        for k in range(first, first + n):  # each environment entered as made: an exit path closes it
            group.append(loop._start(batch, k, n, contexts[k // n],
                                     env=self.free_envs.pop() if self.free_envs else None))
            self.sessions.opened(group[-1].env)
        self.live += n
        if loop.environment is None:
            self.ready.append(("group", group))
            return group
        self.resetting[group[0].group] = n
        for t in group:
            self._observe(t, "reset", group, loop.runner.run_environment_resets, [t.env], [dict(t.context.record)])
        return group

    def _send(self, item: tuple[str, Any], n: int) -> None:
        loop, sampling = self.loop, self.sampling
        kind, what = item
        if kind == "group":  # one request, n samples: the group shares its first turn
            head = what[0]
            settings = loop._settings(sampling, n=n, room=loop._cap(head))
            request = loop._request(head, loop._seed(sampling, 0, head.group, n))
        else:
            if loop.limits.max_context_tokens - len(what.ids) < 1:
                what.ended = "context"
                self._end(what)
                return
            settings = loop._settings(sampling, n=1, room=loop._cap(what))
            request = loop._request(what, loop._seed(sampling, what.num_turns, what.sample_index, 1))
        key = next(self.keys)
        self.sent[key] = item
        self.stream.submit(key, request, settings)

    # ---- a turn came back --------------------------------------------------------------------------------------
    def _turn_done(self, finished: Finished) -> None:
        loop = self.loop
        kind, what = self.sent.pop(finished.key)
        if kind == "group":
            if finished.output is None:
                self.skipped[what[0].group] = finished.skipped
                for t in what:
                    t.ended = "skipped"
                    self._end(t)
                return
            loop._check_echo(what[0], finished.output.prompt_token_ids)
            for t, completion in zip(what, finished.output.completions, strict=True):
                loop._append_turn(t, completion, self.stats)
                self._after_turn(t)
            return
        if finished.output is None:
            what.ended = "context"
            logger.warning("trajectory %s ended: %s", what.sample_index, finished.skipped)
            self._end(what)
            return
        loop._check_echo(what, finished.output.prompt_token_ids)
        loop._append_turn(what, finished.output.completions[0], self.stats)
        self._after_turn(what)

    def _after_turn(self, t: LiveTrajectory) -> None:
        """Start ``t``'s observation (its calls, or its environment's step), or end it."""
        loop = self.loop
        if t.ended is not None:  # its turn hit the token cap
            self._end(t)
            return
        if loop.environment is not None:
            if loop._may_step(t):
                self._observe(t, "step", None, loop.runner.run_environment_steps, [t.env], [t.last_text])
            else:
                self._end(t)
            return
        jobs: list[Any] = []
        items = loop._plan(t, jobs)
        if items is None:
            self._end(t)
        elif jobs:
            self._observe(t, "tools", (items, jobs), loop.runner.run, jobs)
        else:  # only parse errors: answered at once
            loop._answer(t, items, jobs, [], self.stats)
            self._next(t)

    # ---- observations ------------------------------------------------------------------------------------------
    def _observe(self, t: LiveTrajectory | None, kind: str, payload: Any, fn: Any, *args: Any) -> None:
        self.pending[self.executor.submit(fn, *args)] = (kind, t, payload, time.perf_counter())

    def _observed(self, future: concurrent.futures.Future) -> None:
        kind, t, payload, since = self.pending.pop(future)
        result = future.result()  # the runner answers every failure itself: an exception here is a bug, raised
        loop, stats = self.loop, self.stats
        if kind == "close":
            count_close_failures(self.stats, result)
            self.live -= 1  # the session is gone: its slot is free
            return
        t.tool_wait += time.perf_counter() - since
        self.latencies.append(max((sec for _, sec in result), default=0.0))  # as the runner timed the calls
        if kind == "tools":
            items, jobs = payload
            loop._answer(t, items, jobs, result, stats)
            self._next(t)
        elif kind == "step":
            step, sec = result[0]
            loop._stepped(t, step, sec, stats)
            self._next(t)
        else:  # a reset: once the group's resets are all back, its first turns go out
            first, sec = result[0]
            loop._was_reset(t, first, sec, stats)
            group = payload
            self.resetting[t.group] -= 1
            if self.resetting[t.group]:
                return
            del self.resetting[t.group]
            if all(not u.response and u.ended is None for u in group):
                self.ready.append(("group", group))
                return
            for u in group:
                self._next(u)

    def _next(self, t: LiveTrajectory) -> None:
        """After an observation: ``t``'s next turn, or its end (the observation did not fit)."""
        if t.ended is not None:
            self._end(t)
        else:
            self.ready.append(("turn", t))

    # ---- endings -----------------------------------------------------------------------------------------------
    def _end(self, t: LiveTrajectory) -> None:
        """``t`` is over: stamp it, and give its slot back (a reusable environment that is still clean to the pool;
        any other closed first, off this thread, at once even where an abandoned call still runs inside it)."""
        if t.ended_at is None:
            t.ended_at = time.perf_counter() - self.start
        if t.env is None:
            self.live -= 1
        elif reusable(t.env) and t.env_clean:
            self.free_envs.append(t.env)
            self.live -= 1
        else:
            self.sessions.closing(t.env)
            self._observe(None, "close", t.env, self.loop.runner.run_environment_closes, [t.env])
