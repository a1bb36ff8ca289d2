"""The abstract experience maker: the contract every experience maker (naive, fast/vLLM, remote) fulfils."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from mmrlhf.experience.types import Experience


class ExperienceMaker(ABC):
    """Holds the four models of an RL step and turns prompts into :class:`Experience`.

    Args:
        actor: the policy being trained (generates and scores its own samples).
        critic: value model (PPO); ``None`` for critic-free estimators such as GRPO.
        reward_model: a reward model or a reward engine; ``None`` when rewards come from rule functions only.
        initial_model: the frozen reference policy for KL; ``None`` when no KL is used.
    """

    def __init__(
        self,
        actor: torch.nn.Module | Any,
        critic: torch.nn.Module | None = None,
        reward_model: torch.nn.Module | Any | None = None,
        initial_model: torch.nn.Module | None = None,
    ) -> None:
        self.actor = actor
        self.critic = critic
        self.reward_model = reward_model
        self.initial_model = initial_model

    @abstractmethod
    def make_experience(self, *args: Any, **kwargs: Any) -> Experience:
        """Produce one micro-batch of experience (generation, scoring, rewards, advantages)."""

    def make_experience_list(self, *args: Any, **kwargs: Any) -> list[Experience]:
        """Produce a rollout batch as a list of micro-batches. The default makes a single one."""
        return [self.make_experience(*args, **kwargs)]
