"""``agent``: multi-turn, tool-using (or environment) rollouts through the turn loop
(:class:`~mmrlhf.agents.rollout.AgentLoop`); each trajectory is one row (:mod:`mmrlhf.experience.agent_rows`)."""

from __future__ import annotations

from typing import Any

import torch

from mmrlhf.experience.agent_rows import rows_from_trajectories, tool_contexts, zero_out_of_budget
from mmrlhf.experience.kinds.base import Generated, KindSetup, RolloutCall
from mmrlhf.experience.rollout import Rollout
from mmrlhf.rewards.types import RewardResult


class AgentKind:
    """Trajectories of the turn loop the builder made from the ``agent`` section (``setup.agent``)."""

    multi_turn = True

    def __init__(self, setup: KindSetup) -> None:
        if setup.agent is None:
            raise ValueError("rollout kind 'agent' needs the turn loop: configure agent.tools or agent.environment")
        if setup.out_of_budget_reward not in ("score", "zero"):
            raise ValueError(f"out_of_budget_reward must be 'score' or 'zero', got {setup.out_of_budget_reward!r}")
        self.loop = setup.agent
        self.out_of_budget_reward = setup.out_of_budget_reward

    def generate(self, call: RolloutCall) -> Generated:
        """The turn loop over the batch; its tool time is a phase of its own (``time/tools``), not generation."""
        contexts = tool_contexts(call.batch, call.n, call.data_processor, call.adapter, **call.columns)
        with call.timer("generate"):
            result = self.loop.run(call.batch, call.n, call.sampling, contexts)
        call.timer.move(result.seconds.get("tools", 0.0), source="generate", target="tools")
        prompts = len({s.group for s in result.samples})
        return Generated(rows_from_trajectories(call.batch, result), prompts, result.skipped, result.generated_tokens,
                         result.metrics)

    def responses(self, rows: Rollout, tokenizer: Any) -> list[str]:
        """Each trajectory's final assistant message (the decoded ids would mix in the observations); functions
        that read the whole trajectory get it as the batch's ``trajectories``."""
        return [t.final_answer for t in rows.trajectories]

    def after_rewards(self, rows: Rollout, result: RewardResult) -> dict[str, float]:
        if self.out_of_budget_reward == "zero":
            zero_out_of_budget(result, rows.trajectories)
        return reward_by_tool_use(rows, result.rewards)


def reward_by_tool_use(rows: Rollout, rewards: torch.Tensor) -> dict[str, float]:
    """Mean raw reward of the trajectories that called a tool and of those that did not (absent when none did):
    whether using the tool pays is the first thing to watch in a tool-use run."""
    used = torch.tensor([t.num_tool_calls > 0 for t in rows.trajectories], dtype=torch.bool)  # [N]
    out = {}
    for name, pick in (("with_tool", used), ("without_tool", ~used)):
        if bool(pick.any()):
            out[f"agent/reward/{name}"] = float(rewards[pick].float().mean())
    return out
