"""The turn loop's plain data: its budgets (:class:`AgentLimits`), the images it encodes (:class:`EncodedImage`), the
finished trajectories it returns (:class:`AgentSample`, :class:`AgentResult`) and what a step's turns counted
(:class:`LoopStats`, the ``agent/*`` metrics). Apart from the loop (:mod:`mmrlhf.agents.rollout`) so that its readers
(the experience rows, the builder) need not read the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mmrlhf.agents.types import ERROR_KINDS, Trajectory
from mmrlhf.config.agent import AgentConfig


@dataclass
class EncodedImage:
    """One image as the model sees it: the resized PIL image (what the engine receives), its processor tensors
    (``pixel_values`` [rows, D], ``image_grid_thw`` [1, 3]) and its token count."""

    image: Any
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    tokens: int


ImageEncoder = Callable[[list[Any]], list[EncodedImage]]
"""Encodes tool-returned images (resize under the data's pixel bounds, then the processor), one result per image;
raises ``ValueError`` naming the image on one it cannot encode."""


@dataclass(frozen=True)
class AgentLimits:
    """The budgets of one trajectory, and how many run at once (from :class:`~mmrlhf.config.agent.AgentConfig`)."""

    max_turns: int = 4
    max_tool_calls: int = 8
    max_context_tokens: int = 4096
    max_new_tokens_per_turn: int = 1024
    max_images: int = 8
    stop_at_tool_call: bool = True
    max_concurrent_trajectories: int | None = None  # live at once, whole groups; None: the step's batch at once
    # "async": each trajectory on its own (mmrlhf.agents.async_loop); "lockstep": in waves; "auto": async over an
    # engine whose continuous-batch stream has run on this kind of machine (mmrlhf.rollout.streaming.auto_loop)
    loop: str = "auto"
    # the asynchronous loop: seconds it waits for calls that just started before the engine's next step, so that
    # the turns they make ready go to the engine together (0: never); the config's default (one source for both)
    gather_window_s: float = AgentConfig.model_fields["gather_window_s"].default

    def __post_init__(self) -> None:
        if self.loop not in ("auto", "async", "lockstep"):
            raise ValueError(f"agent.loop must be 'auto', 'async' or 'lockstep', got {self.loop!r}")
        if not self.gather_window_s >= 0:
            raise ValueError(f"agent.gather_window_s must be >= 0, got {self.gather_window_s!r}")


@dataclass
class AgentSample:
    """One finished trajectory in the row form the experience maker trains on."""

    sample_index: int  # index into the processor's batch
    group: int  # the prompt (request) it was sampled from
    prompt_ids: list[int]  # the first prompt, shared by the group
    response_ids: list[int]  # every token after the prompt: turns and observations
    policy_mask: list[int]  # per response token: 1 policy, 0 observation
    engine_logprobs: list[float] | None  # per response token (0.0 on observation tokens)
    finished: bool  # ended by an answer or the environment (False: a budget ended it)
    vision: dict[str, torch.Tensor]  # the prompt's processor tensors with every tool image appended, in order
    images: list[Any]  # the prompt's images then the tool images (as the model saw them)
    trajectory: Trajectory
    # rollout.routing_replay: [tokens the engine ran, L, k] int16, over prompt + response (a token routed when its
    # turn's request ran it: the prompt and every observation by the turn after it, each policy token by its own
    # turn); None without routing
    routed_experts: torch.Tensor | None = None
    # rollout.partial: per response token the policy version that sampled it (observation tokens: the version of the
    # turn before them, never trained); None: one version, the engine's
    token_versions: list[int] | None = None


@dataclass
class AgentResult:
    samples: list[AgentSample]  # in sample order
    skipped: dict[int, str]  # request index -> reason (the first turn's prompt did not fit)
    generated_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)



@dataclass
class LoopStats:
    """What one step's turns counted (tokens, tool latencies, errors, calls per tool), turned into its metrics."""

    generated: int = 0
    observation_tokens: int = 0
    latency: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    calls_by_tool: dict[str, int] = field(default_factory=dict)
    empty: int = 0  # trajectories left out: ended before their first turn
    reset_failed: int = 0  # trajectories whose environment's reset failed or timed out (left out, among ``empty``)
    escaped: int = 0  # shown results whose text held an added token's string (escaped: mmrlhf.agents.plain_text)
    trajectory_seconds: list[float] = field(default_factory=list)  # per kept trajectory: rollout start to its end
    tool_wait: list[float] = field(default_factory=list)  # per kept trajectory: seconds waiting on tools
    engine_busy: float = 0.0  # share of the rollout's seconds the engine was generating

    def metrics(self, samples: list[AgentSample]) -> dict[str, float]:
        """Per-step agent metrics (docs/agents.md lists them): means per trajectory and counts."""
        n = max(len(samples), 1)
        trajs = [s.trajectory for s in samples]
        policy = sum(sum(s.policy_mask) for s in samples)
        out = {
            "agent/turns/mean": sum(t.num_turns for t in trajs) / n,
            "agent/tool_calls/mean": sum(t.num_tool_calls for t in trajs) / n,
            "agent/tool_use_rate": sum(t.num_tool_calls > 0 for t in trajs) / n,
            "agent/errors/mean": sum(len(t.errors) for t in trajs) / n,
            "agent/out_of_budget_rate": sum(t.out_of_budget for t in trajs) / n,
            "agent/policy_tokens/mean": policy / n,
            "agent/observation_tokens/mean": sum(len(s.policy_mask) - sum(s.policy_mask) for s in samples) / n,
            "agent/tool_latency/mean": sum(self.latency) / len(self.latency) if self.latency else 0.0,
            "agent/tool_latency/max": max(self.latency, default=0.0),
            "agent/tool_wait_s/mean": sum(self.tool_wait) / len(self.tool_wait) if self.tool_wait else 0.0,
            "agent/trajectory_s/p50": quantile(self.trajectory_seconds, 0.5),
            "agent/trajectory_s/p95": quantile(self.trajectory_seconds, 0.95),
            "agent/trajectory_s/max": max(self.trajectory_seconds, default=0.0),
            "agent/engine_busy_frac": self.engine_busy,
        }
        for kind in ERROR_KINDS:
            out[f"agent/errors/{kind}/count"] = float(self.errors.get(kind, 0))
        for name, count in self.calls_by_tool.items():
            out[f"agent/calls/{name}/count"] = float(count)
        for ending in ("answer", "done", "max_turns", "context", "length"):
            out[f"agent/ended/{ending}/count"] = float(sum(t.ended == ending for t in trajs))
        out["agent/ended/before_first_turn/count"] = float(self.empty)
        out["agent/ended/reset_failed/count"] = float(self.reset_failed)
        out["agent/escaped_texts/count"] = float(self.escaped)
        return out


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (0.0 for none): a value that occurred, never an interpolation."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
