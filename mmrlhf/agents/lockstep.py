"""The lockstep turn loop (``agent.loop: lockstep``): every live trajectory of a wave generates its turn in one
batch of engine calls, then all the wave's tool calls run together, then every next turn is requested.

Simple and the reference the asynchronous loop (:mod:`mmrlhf.agents.async_loop`) is tested against: both sample
the same trajectories, since every turn draws from its own trajectory's seed (:meth:`AgentLoop._seed`) with the same
token cap (:meth:`AgentLoop._cap`). Its cost is the wait: one slow tool call or one long turn holds the whole wave at
every turn, and the engine idles while tools run.

Each wave's environments are made for it and closed when it ends, on every exit path (an exception included:
:class:`~mmrlhf.agents.sessions.Sessions`); none is reused, so an environment a failed call left unclean never
serves another trajectory.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from mmrlhf.agents.live import LiveTrajectory, mark_ended, waited
from mmrlhf.agents.loop_types import LoopStats
from mmrlhf.agents.sessions import Sessions
from mmrlhf.agents.types import ToolCall, ToolContext
from mmrlhf.rollout.types import SamplingSettings

logger = logging.getLogger(__name__)


class Lockstep:
    """One step's trajectories in waves of whole groups (``agent.max_concurrent_trajectories``), lockstep within a
    wave; each wave's environments are closed before the next starts."""

    def __init__(self, loop: Any, sampling: SamplingSettings, stats: LoopStats, seconds: dict[str, float],
                 start: float) -> None:
        self.loop, self.sampling, self.stats, self.seconds, self.start = loop, sampling, stats, seconds, start

    def run(self, batch: Any, n: int, contexts: Sequence[ToolContext]) -> tuple[list[LiveTrajectory], dict[int, str]]:
        """Every trajectory of the step and the groups the engine skipped (group -> reason)."""
        skipped: dict[int, str] = {}
        everyone: list[LiveTrajectory] = []
        for wave in self._waves(len(batch), n):
            sessions = Sessions(self.loop.runner, self.stats)
            done = False
            try:
                live = []
                for k in wave:  # each environment entered as made: an exit path closes it
                    live.append(self.loop._start(batch, k, n, contexts[k // n]))
                    sessions.opened(live[-1].env)
                skipped.update(self._run_wave(live, n))
                everyone += live
                done = True
            finally:  # closed under the tool deadline; a close that fails is counted (logged, if the step fails)
                t_close = time.perf_counter()
                sessions.close_all(failing=not done)
                self.seconds["tools"] += time.perf_counter() - t_close
        return everyone, skipped

    def _waves(self, size: int, n: int) -> list[range]:
        """The step's sample indices in waves of whole groups, at most ``max_concurrent_trajectories`` each (one
        group at least); one wave without a limit."""
        limit = self.loop.limits.max_concurrent_trajectories
        per = size if limit is None else max(1, limit // n) * n
        return [range(lo, min(lo + per, size)) for lo in range(0, size, max(per, 1))]

    def _run_wave(self, live: list[LiveTrajectory], n: int) -> dict[int, str]:
        loop, seconds, start = self.loop, self.seconds, self.start
        skipped: dict[int, str] = {}
        if loop.environment is not None:
            t_reset = time.perf_counter()
            resets = loop.runner.run_environment_resets([t.env for t in live], [dict(t.context.record) for t in live])
            for t, (first, sec) in zip(live, resets):
                loop._was_reset(t, first, sec, self.stats)
            waited(live, time.perf_counter() - t_reset, seconds)
        # a group whose environments all gave no first observation shares its first turn (one request, n samples)
        groups = [live[i: i + n] for i in range(0, len(live), n)]
        shared = [g for g in groups if all(not t.response and t.ended is None for t in g)]
        turn = 0
        while True:
            active = [t for t in live if t.ended is None]
            if not active:
                break
            t_gen = time.perf_counter()
            if turn == 0 and shared:
                skipped = self._first_turn(shared, n)
                in_shared = {id(t) for g in shared for t in g}
                self._next_turn([t for t in active if id(t) not in in_shared])
            else:
                self._next_turn(active)
            seconds["generate"] += time.perf_counter() - t_gen
            mark_ended(live, time.perf_counter() - start)
            turn += 1
            t_obs = time.perf_counter()
            observing = [t for t in active if t.ended is None]
            self._observe(observing)
            # a trajectory its turn ended (an answer, the turn budget) did not wait for the step's tools
            parsed = ("max_turns",) if loop.environment is not None else ("answer", "max_turns")
            for t in observing:
                if t.ended in parsed:
                    t.ended_at = t_obs - start
            waited([t for t in observing if t.ended_at is None], time.perf_counter() - t_obs, seconds)
            mark_ended(live, time.perf_counter() - start)
        return skipped

    def _first_turn(self, groups: list[list[LiveTrajectory]], n: int) -> dict[int, str]:
        """One request per group with ``n`` completions (the group shares its first turn), grouped by token cap;
        returns the groups the engine skipped (the group's index in the step -> reason)."""
        loop, sampling = self.loop, self.sampling
        heads = [g[0] for g in groups]
        skipped: dict[int, str] = {}
        for cap, members in _buckets(loop, heads):
            settings = loop._settings(sampling, n=n, room=cap)
            result = loop.engine.generate([loop._request(heads[i], loop._seed(sampling, 0, heads[i].group, n))
                                           for i in members], settings)
            for out in result.outputs:
                head = members[out.request_index]
                loop._check_echo(heads[head], out.prompt_token_ids)
                for t, completion in zip(groups[head], out.completions, strict=True):
                    loop._append_turn(t, completion, self.stats)
            for i, reason in result.skipped.items():
                skipped[heads[members[i]].group] = reason
                for t in groups[members[i]]:
                    t.ended = "skipped"
        return skipped

    def _next_turn(self, active: list[LiveTrajectory]) -> None:
        """One request per live trajectory; each may generate what is left of its context (capped per turn)."""
        loop, sampling = self.loop, self.sampling
        ready = []
        for t in active:
            if loop.limits.max_context_tokens - len(t.ids) < 1:
                t.ended = "context"
            else:
                ready.append(t)
        for cap, members in _buckets(loop, ready):
            settings = loop._settings(sampling, n=1, room=cap)
            group = [ready[i] for i in members]
            result = loop.engine.generate([loop._request(t, loop._seed(sampling, t.num_turns, t.sample_index, 1))
                                           for t in group], settings)
            for out in result.outputs:
                loop._check_echo(group[out.request_index], out.prompt_token_ids)
                loop._append_turn(group[out.request_index], out.completions[0], self.stats)
            for i, reason in result.skipped.items():
                group[i].ended = "context"
                logger.warning("trajectory %s ended: %s", group[i].sample_index, reason)

    def _observe(self, active: list[LiveTrajectory]) -> None:
        """Parse every live trajectory's last turn, run all calls of the wave together, append observations."""
        loop = self.loop
        if loop.environment is not None:
            ready = [t for t in active if loop._may_step(t)]
            steps = loop.runner.run_environment_steps([t.env for t in ready], [t.last_text for t in ready])
            for t, (step, sec) in zip(ready, steps):
                loop._stepped(t, step, sec, self.stats)
            return
        plans: list[tuple[LiveTrajectory, list[Any]]] = []
        jobs: list[tuple[ToolCall, ToolContext]] = []
        for t in active:
            items = loop._plan(t, jobs)
            if items is not None:
                plans.append((t, items))
        ran = loop.runner.run(jobs) if jobs else []
        for t, items in plans:
            loop._answer(t, items, jobs, ran, self.stats)


def _buckets(loop: Any, trajectories: Sequence[LiveTrajectory]) -> list[tuple[int, list[int]]]:
    """Positions of ``trajectories`` grouped by their next turn's token cap (the engine takes one setting per
    call), the largest cap first."""
    buckets: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        buckets.setdefault(loop._cap(t), []).append(i)
    return sorted(buckets.items(), reverse=True)
