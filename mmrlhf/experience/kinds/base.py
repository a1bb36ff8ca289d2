"""The rollout-kind protocol: what the experience maker asks of the thing that turns a processed batch into rows.

Why a protocol: single-turn generation, the multi-turn turn loop and whatever comes next (partial rollouts, an
environment pool, a judge in the loop) differ only in how a step's responses come about and in a few facts about
them. The maker keeps the orchestration (prepare, reward, forwards, shaping, advantages) and holds one kind, so a
new kind is one class and the maker has no branch per kind.

A kind is a class, constructed as ``Kind(setup, **rollout.kind_options)``, with:

- ``multi_turn`` (class attribute): its rows carry a policy mask (observation tokens inside responses) and a
  trajectory each; the builders read it before anything runs (the shared-prompt layout's ``auto`` depends on it);
- ``generate(call) -> Generated``: the rows (:class:`~mmrlhf.experience.rollout.Rollout`, sample order) of one call;
- ``responses(rows, tokenizer) -> list[str]``: the text the reward functions score, one per row;
- ``after_rewards(rows, result) -> dict[str, float]``: adjust the raw rewards in place where the kind has a rule
  for it (``agent.out_of_budget_reward``), and the kind's reward metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Protocol, Sequence

from mmrlhf.experience.rollout import Rollout
from mmrlhf.experience.timing import PhaseTimer
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import SamplingSettings


@dataclass(frozen=True)
class KindSetup:
    """What the builder hands every kind's constructor besides its options: the pieces built from other sections."""

    agent: Any = None  # the turn loop (mmrlhf.agents.rollout.AgentLoop) when agent.enabled, else None
    out_of_budget_reward: str = "score"  # agent.out_of_budget_reward: "score" or "zero"


@dataclass
class RolloutCall:
    """One generation call: the processor's batch (``n`` samples per kept prompt, in order), the call's sampling
    settings, the maker's parts, and the caller's per-prompt columns (``prompts``, ``images``, ``videos``,
    ``references``, ``labels``, ``record_ids``, ``base_dirs``, ``extras``: what a tool or an environment may read)."""

    batch: Any  # mmrlhf.data.processor's processed batch
    n: int
    sampling: SamplingSettings
    timer: PhaseTimer  # a kind times its engine work as "generate" (and may add phases of its own)
    engine: Any
    data_processor: Any
    tokenizer: Any
    adapter: Any
    eos_ids: Sequence[int]
    check_prompt_ids: bool  # check the engine saw the processor's prompt ids (ExperienceSettings.check_prompt_ids)
    columns: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Generated:
    """What a kind returns for one call."""

    rows: Rollout
    prompts: int  # prompts generated
    skipped: dict  # the engine's skipped prompts: index -> reason
    generated_tokens: int  # tokens the policy generated (its own, not observations)
    metrics: dict[str, float] = field(default_factory=dict)  # the kind's own (e.g. agent/*)


class RolloutKind(Protocol):
    """See the module docstring."""

    multi_turn: ClassVar[bool]

    def generate(self, call: RolloutCall) -> Generated: ...

    def responses(self, rows: Rollout, tokenizer: Any) -> list[str]: ...

    def after_rewards(self, rows: Rollout, result: RewardResult) -> dict[str, float]: ...


PROTOCOL_MEMBERS = ("multi_turn", "generate", "responses", "after_rewards")
"""The members a kind class must have (checked when it is resolved, so a broken plug-in fails the run's start)."""
