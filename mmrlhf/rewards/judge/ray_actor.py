"""The judge on its own Ray actor (``backend: ray``): one vLLM engine per judge source, in a named actor with its
own CPUs / GPUs, created once per run and shared by every process that scores with it.

Why an actor: a judge as large as the policy (or larger) does not fit beside the policy's engine, and a judge per
rollout actor would load the same weights N times. One named actor holds the engine; every rollout actor's reward
engine (and a one-process run's) reaches it by name, sends its rendered requests and gets the replies back. The
rubric, cache, scoring and notes stay in each caller's :class:`~mmrlhf.rewards.judge.source.JudgeSource`; only the
engine call crosses the process boundary.

The actor merges the requests of callers that arrive while a generate runs into the next generate (one batched
``LLM.chat``), so N rollout actors scoring at once cost the engine about one batch, not N turns.

Who creates it: under ``distributed.backend=ray`` the driver (:func:`start_judge_actors`, before the rollout
actors, so the engine's start is not counted in a step and the actor lives as long as the run, not as long as the
rollout actor that happened to ask first); in a one-process run the first scoring call creates it (joining
``RAY_ADDRESS`` or starting a local Ray with the actor's CPUs). Either way ``get_if_exists`` makes the name the
single point of truth.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Awaitable, Callable

from mmrlhf.rewards.judge.backends import JudgeCallError, JudgeReply, VllmJudge
from mmrlhf.rewards.judge.rubric import JudgeRequest

logger = logging.getLogger(__name__)

ACTOR_PREFIX = "mmrlhf-judge-"
_CONNECT_LOCK = threading.Lock()


def judge_actor_name(source: str) -> str:
    """The Ray actor name of the judge source called ``source`` (unique within a Ray job's namespace)."""
    return ACTOR_PREFIX + source


class MergingRunner:
    """Runs ``run(requests)`` one call at a time; the calls that arrive while one runs are merged into the next
    (no timer: a lone call goes at once), and each caller gets its own slice of the replies back. A merged call
    that raises is run again caller by caller, so one caller's bad request (a prompt over the engine's context,
    say) never fails another's."""

    def __init__(self, run: Callable[[list], Awaitable[list]]) -> None:
        self._run = run
        self._waiting: list[tuple[list, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.calls = 0
        self.runs = 0

    async def __call__(self, requests: list) -> list:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((requests, future))
        self.calls += 1
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            group, self._waiting = self._waiting, []
            await self._run_group(group)

    async def _run_group(self, group: list[tuple[list, asyncio.Future]]) -> None:
        self.runs += 1
        try:
            replies = await self._run([r for requests, _ in group for r in requests])
        except Exception as exc:  # noqa: BLE001 - the caller's, or each caller alone again
            if len(group) == 1:
                if not group[0][1].done():
                    group[0][1].set_exception(exc)
                return
            logger.warning("a merged judge call of %d callers failed (%s); running them one by one", len(group), exc)
            for one in group:
                await self._run_group([one])
            return
        start = 0
        for requests, future in group:
            if not future.done():
                future.set_result(replies[start:start + len(requests)])
            start += len(requests)


class JudgeEngineActor:
    """The actor's body (wrapped with ``ray.remote``): a :class:`VllmJudge` behind a :class:`MergingRunner`."""

    def __init__(self, path: str, *, max_tokens: int, top_logprobs: int, engine_options: dict[str, Any],
                 chat_template_kwargs: dict[str, Any], threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.judge = VllmJudge(path, max_tokens=max_tokens, top_logprobs=top_logprobs, engine_options=engine_options,
                               chat_template_kwargs=chat_template_kwargs)
        self.judge._engine()  # loaded now: a caller's first step does not pay the engine's start
        self.runner = MergingRunner(self.judge.run)

    async def run(self, requests: list[JudgeRequest]) -> list[JudgeReply | Exception]:
        return await self.runner(requests)

    def stats(self) -> dict[str, Any]:
        """Calls received, engine calls made and the process id (tests check that callers share one engine)."""
        import os

        return {"calls": self.runner.calls, "generates": self.runner.runs, "pid": os.getpid()}


def actor_resources(name: str, cfg: Any, cluster_gpus: float) -> tuple[float, float]:
    """(CPUs, GPUs) of the actor of judge source ``name`` (config ``cfg``) on a cluster with ``cluster_gpus`` GPUs:
    ``actor_gpus`` unset means the engine's ``tensor_parallel_size`` (1) on a GPU cluster and 0 on a CPU one;
    refused by key where it cannot work (GPUs asked of a CPU cluster, 0 GPUs on a GPU cluster)."""
    from mmrlhf.parallel.ray_actors import resolve_actor_gpus

    tp = float(cfg.engine.get("tensor_parallel_size", 1))
    key = f"reward.label_map.{name}.actor_gpus"
    return cfg.actor_cpus, resolve_actor_gpus(cfg.actor_gpus, key, tp, cluster_gpus)


def ensure_judge_actor(name: str, cfg: Any) -> Any:
    """The handle of the judge actor of source ``name`` (config ``cfg``), created here if no process did yet."""
    import ray

    from mmrlhf.parallel.ray_actors import actor_options, actor_threads

    cpus, gpus = actor_resources(name, cfg, float(ray.cluster_resources().get("GPU", 0.0)))
    options = actor_options(judge_actor_name(name), cpus, gpus)
    options["get_if_exists"] = True
    top = cfg.top_logprobs if cfg.scoring == "verdict_prob" else 0
    return ray.remote(JudgeEngineActor).options(**options).remote(
        cfg.model, max_tokens=cfg.max_tokens, top_logprobs=top, engine_options=dict(cfg.engine),
        chat_template_kwargs=dict(cfg.chat_template_kwargs), threads=actor_threads(cpus))


def ray_judges(reward_cfg: Any) -> dict[str, Any]:
    """The judge sources of a ``reward`` config section that run on their own Ray actor, by source name."""
    return {name: src for name, src in reward_cfg.label_map.items()
            if getattr(src, "type", None) == "judge" and src.backend == "ray"}


def start_judge_actors(reward_cfg: Any) -> list[Any]:
    """Create (and wait for) the judge actors of the run's ``reward`` config; the caller owns them: they live as
    long as it does (the Ray driver kills them at the end)."""
    import ray

    handles = [ensure_judge_actor(name, cfg) for name, cfg in ray_judges(reward_cfg).items()]
    ray.get([h.stats.remote() for h in handles])  # engines loaded before the first step
    return handles


class RayActorJudge:
    """The backend of ``backend: ray``: the named actor's engine, reached from any process of the run."""

    def __init__(self, name: str, cfg: Any) -> None:
        import os

        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not os.environ.get("RAY_ADDRESS"):
            # each torchrun rank would start a Ray of its own, and so a judge engine of its own
            raise ValueError(f"reward.label_map.{name}.backend=ray under torchrun needs a Ray cluster the ranks "
                             "share: start one (ray start --head) and set RAY_ADDRESS, or use backend endpoint")
        self.name = name
        self.cfg = cfg
        self.actor_name = judge_actor_name(name)
        self._handle: Any = None

    def handle(self) -> Any:
        with _CONNECT_LOCK:  # two judge sources' first calls run at once: one Ray start, one creation each
            return self._handle_locked()

    def _handle_locked(self) -> Any:
        if self._handle is None:
            import ray

            if not ray.is_initialized():
                from mmrlhf.parallel.ray_actors import connect

                connect(None, num_cpus=self.cfg.actor_cpus)
                logger.info("judge %r: joined or started Ray for its actor %s", self.name, self.actor_name)
            self._handle = ensure_judge_actor(self.name, self.cfg)
        return self._handle

    async def run(self, requests: list[JudgeRequest]) -> list[JudgeReply | Exception]:
        """The actor's replies; each one's ``queue_s`` is the round trip less its generate (finding or creating the
        actor, the trip both ways, waiting in the actor behind other callers' generates): durations measured in
        this process, so no clock is compared across machines."""
        start = time.monotonic()
        try:
            handle = await asyncio.to_thread(self.handle)  # creating it may wait for resources
            replies = await handle.run.remote(requests)
        except Exception as exc:  # noqa: BLE001 - the actor died or refused: each request fails, naming it
            from mmrlhf.parallel.ray_actors import describe_actor_error

            error = JudgeCallError(f"judge actor {self.actor_name}: {type(exc).__name__}: "
                                   f"{describe_actor_error(exc)}")
            return [error] * len(requests)
        elapsed = time.monotonic() - start
        for reply in replies:
            if isinstance(reply, JudgeReply):
                reply.queue_s = max(0.0, elapsed - reply.latency_s)
        return replies
