"""Reward sources: one uniform ``async score(batch) -> SourceScores`` over functions, local models, remote servers.

The engine only ever talks to this interface, so the recipe filtering, failure policy and scatter-back are written
once. ``SOURCE_TYPES`` maps the config's ``type`` to a builder; it is the single place a source kind is chosen.
"""

from __future__ import annotations

import json
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from mmrlhf.registry import Registry
from mmrlhf.rewards.functions import load_reward_function
from mmrlhf.rewards.plugins import call_reward_function, function_name
from mmrlhf.rewards.types import RewardBatch, SourceScores


@runtime_checkable
class RewardSource(Protocol):
    """Anything with a ``name`` and an async ``score`` giving one entry per sample of the batch, in order."""

    name: str

    async def score(self, batch: RewardBatch) -> SourceScores: ...


class FunctionSource:
    """A reward function (built-in or plugin) with fixed keyword ``options``.

    A synchronous function runs in a thread of ``executor`` (default: a small pool shared by the process), never on
    the event loop's thread: remote requests and other sources keep going while it computes.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        options: Mapping[str, Any] | None = None,
        executor: Executor | None = None,
        timeout_s: float | None = None,
    ):
        self.fn = fn
        self.name = name or function_name(fn)
        self.options = dict(options or {})
        self.executor = executor
        self.timeout_s = timeout_s  # the engine's bound on one call of score() (None: unbounded)

    async def score(self, batch: RewardBatch) -> SourceScores:
        if len(batch) == 0:
            return SourceScores.empty(0)
        fname = function_name(self.fn)
        label = self.name if self.name == fname else f"{self.name} [{fname}]"  # errors name source AND function
        return await call_reward_function(self.fn, batch, name=label, options=self.options, executor=self.executor)


class ClientSource:
    """A remote reward server, through :class:`~mmrlhf.rewards.remote.RemoteRewardClient`."""

    def __init__(self, client: Any, *, name: str) -> None:
        self.client = client
        self.name = name

    async def score(self, batch: RewardBatch) -> SourceScores:
        return await self.client.score(batch)


SOURCE_TYPES: Registry[Callable[..., RewardSource]] = Registry("reward source type")
"""Builders ``fn(name, cfg, executor=None) -> RewardSource``; ``executor`` runs synchronous functions."""


@SOURCE_TYPES.register("function")
def _function_source(name: str, cfg: Any, executor: Executor | None = None) -> RewardSource:
    return FunctionSource(load_reward_function(cfg.function), name=name, options=cfg.options, executor=executor,
                          timeout_s=cfg.timeout_s)


@SOURCE_TYPES.register("model")
def _model_source(name: str, cfg: Any, executor: Executor | None = None) -> RewardSource:
    from mmrlhf.rewards.local_model import LocalRewardModel, build_reward_model

    module = build_reward_model(cfg.model, path=cfg.path, dtype=cfg.dtype, **cfg.options)
    source = LocalRewardModel(
        module, name=name, device=cfg.device, offload_device=cfg.offload_device, micro_batch_size=cfg.micro_batch_size
    )
    source.timeout_s = cfg.timeout_s  # the engine's bound on one call of score()
    return source


@SOURCE_TYPES.register("remote")
def _remote_source(name: str, cfg: Any, executor: Executor | None = None) -> RewardSource:
    from mmrlhf.rewards.remote import RemoteRewardClient, read_token

    client = RemoteRewardClient(
        cfg.url,
        token=read_token(cfg.token_file) if cfg.token_file else None,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.max_retries,
        backoff_s=cfg.backoff_s,
        backoff_max_s=cfg.backoff_max_s,
        retry_window_s=cfg.retry_window_s,
        batch_size=cfg.batch_size,
        max_concurrency=cfg.max_concurrency,
        send_images=cfg.send_images,
    )
    return ClientSource(client, name=name)


@SOURCE_TYPES.register("judge")
def _judge_source(name: str, cfg: Any, executor: Executor | None = None) -> RewardSource:
    from mmrlhf.rewards.judge.backends import EndpointJudge, VllmJudge
    from mmrlhf.rewards.judge.rubric import judge_special_tokens, load_rubric
    from mmrlhf.rewards.judge.source import JudgeSource
    from mmrlhf.rewards.remote import read_token

    top = cfg.top_logprobs if cfg.scoring == "verdict_prob" else 0
    if cfg.backend == "endpoint":
        backend: Any = EndpointJudge(
            cfg.url, cfg.model, max_tokens=cfg.max_tokens, top_logprobs=top,
            api_key=read_token(cfg.api_key_file) if cfg.api_key_file else None, timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries, backoff_s=cfg.backoff_s, backoff_max_s=cfg.backoff_max_s,
            max_concurrency=cfg.max_concurrency, chat_template_kwargs=cfg.chat_template_kwargs,
        )
        judge_id = f"{cfg.url}#{cfg.model}"
    elif cfg.backend == "ray":
        from mmrlhf.rewards.judge.ray_actor import RayActorJudge

        backend = RayActorJudge(name, cfg)
        judge_id = cfg.model
    else:
        backend = VllmJudge(cfg.model, max_tokens=cfg.max_tokens, top_logprobs=top, sleep=cfg.sleep,
                            engine_options=cfg.engine, chat_template_kwargs=cfg.chat_template_kwargs)
        judge_id = cfg.model
    if cfg.chat_template_kwargs:  # the template's variables change what the judge sees: part of the cache key
        judge_id += "#" + json.dumps(cfg.chat_template_kwargs, sort_keys=True, default=str)
    return JudgeSource(backend, name=name, judge_id=judge_id, rubric=load_rubric(cfg.rubric), scoring=cfg.scoring,
                       verdicts=cfg.verdicts, score_range=cfg.score_range, question_column=cfg.question_column,
                       cache_size=cfg.cache_size, timeout_s=cfg.timeout_s, reserved=judge_special_tokens(cfg.model))


def build_source(name: str, cfg: Any, *, executor: Executor | None = None) -> RewardSource:
    """The source described by one ``label_map`` entry (dispatching on its ``type``); ``executor`` runs
    synchronous reward functions (None: the process's shared pool)."""
    return SOURCE_TYPES.get(cfg.type)(name, cfg, executor=executor)
