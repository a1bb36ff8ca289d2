"""A trajectory the turn loop (:mod:`mmrlhf.agents.rollout`) is building, and the bookkeeping of its time: how long
it waited on tools and when it ended (the loop's long-tail metrics, :class:`~mmrlhf.agents.loop_types.LoopStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmrlhf.agents.types import ToolContext, TurnRecord


@dataclass
class LiveTrajectory:
    """A trajectory under construction: its tokens, images and turns so far, how it ended and its timing."""

    sample_index: int
    group: int
    prompt_ids: list[int]
    vision: dict[str, torch.Tensor]
    images: list[Any]
    context: ToolContext
    env: Any = None
    # False once a reset or step of ``env`` failed (raised, timed out: its thread may still run inside it): the env
    # is then closed when the trajectory ends, never pooled for the next one
    env_clean: bool = True
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    tool_pixels: list[torch.Tensor] = field(default_factory=list)
    tool_grids: list[torch.Tensor] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    calls: int = 0
    ended: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    last_text: str = ""
    tool_wait: float = 0.0  # seconds it waited on tools and environments (in lockstep: the step's, every turn)
    ended_at: float | None = None  # seconds from the rollout's start to its end
    # rollout.routing_replay: [tokens the engine ran, L, k] int16 experts, each turn's new rows stitched on (None:
    # the engine returns no routing)
    routed: torch.Tensor | None = None
    # rollout.partial: per response token the policy version that sampled it (an observation's tokens: the version
    # of the turn before it; they are never trained); None: the engine reports no versions
    versions: list[int] | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response

    @property
    def num_turns(self) -> int:
        return sum(r.role == "assistant" for r in self.turns)


def waited(trajectories: list[LiveTrajectory], seconds: float, phases: dict[str, float]) -> None:
    """A tool phase of ``seconds``: every trajectory in it waited that long (the loop goes on when the step's last
    call returns, so a trajectory waits for the slowest call of any)."""
    phases["tools"] += seconds
    for t in trajectories:
        t.tool_wait += seconds


def mark_ended(live: list[LiveTrajectory], now: float) -> None:
    """Stamp the trajectories that ended since the last look with ``now`` (seconds since the rollout began)."""
    for t in live:
        if t.ended is not None and t.ended_at is None:
            t.ended_at = now
