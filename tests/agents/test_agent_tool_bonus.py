"""``agent.tool_bonus``, the exploration bonus against interaction collapse (docs/agents.md): paid only to
trajectories that made a successful call and then answered, annealed to exactly 0 after ``tool_bonus_steps``
steps, added in the step's shaping (GRPO advantages see it, the raw rewards do not), and refused by the config
where it cannot apply, naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmrlhf.agents.types import ToolCall, Trajectory, TurnRecord
from mmrlhf.config import ConfigError, build_config, load_config
from mmrlhf.experience.agent_rows import tool_bonus_at, tool_bonus_rewards
from mmrlhf.experience.fast_maker import FastExperienceMaker
from mmrlhf.experience.rollout import Rollout
from mmrlhf.experience.settings import ExperienceSettings, experience_settings
from mmrlhf.experience.step_shaping import shape_step
from mmrlhf.parallel.world import single
from mmrlhf.rewards.types import RewardResult


def _trajectory(calls: int, *, ended: str = "answer", errors: tuple[str, ...] = ()) -> Trajectory:
    turns = []
    for i in range(calls):
        turns += [TurnRecord("assistant", "<tool_call>...</tool_call>", calls=[ToolCall("image_zoom", {})]),
                  TurnRecord("tool", "zoomed", errors=list(errors) if i == 0 else [])]
    if calls == 0 and errors:  # a refused block (bad JSON, bad arguments): an observation, never a call
        turns += [TurnRecord("assistant", "<tool_call>{</tool_call>"), TurnRecord("tool", "error", errors=list(errors))]
    turns.append(TurnRecord("assistant", "red"))
    return Trajectory(turns=turns, final_answer="red", ended=ended)


# ---- the schedule -------------------------------------------------------------------------------------------------
def test_the_bonus_anneals_linearly_to_exactly_zero_after_its_steps():
    assert tool_bonus_at(0, 0.5, 4) == 0.5  # full on the first step (0 steps finished)
    assert [tool_bonus_at(s, 0.5, 4) for s in (1, 2, 3)] == [0.375, 0.25, 0.125]
    assert [tool_bonus_at(s, 0.5, 4) for s in (4, 5, 1000)] == [0.0, 0.0, 0.0]  # exactly 0: the task's objective
    assert sum(tool_bonus_at(s, 0.5, 60) > 0 for s in range(200)) == 60  # exactly the first 60 steps pay
    assert [tool_bonus_at(s, 0.5, None) for s in (0, 59, 10_000)] == [0.5, 0.5, 0.5]  # never annealed
    assert tool_bonus_at(7, 0.0, None) == 0.0
    with pytest.raises(ValueError, match="step must be >= 0"):
        tool_bonus_at(-1, 0.5, 4)


# ---- who is paid --------------------------------------------------------------------------------------------------
def test_only_trajectories_that_called_successfully_and_answered_are_paid():
    trajectories = [
        _trajectory(1),  # called, answered: paid
        _trajectory(0),  # the control: answered without a call
        _trajectory(2),  # two calls: paid once, not per call
        _trajectory(1, ended="max_turns"),  # called until the budget ended it: paying it teaches calling forever
        _trajectory(1, errors=("tool_raised",)),  # its only call failed
        _trajectory(0, errors=("bad_arguments",)),  # a refused block never became a call
        _trajectory(2, errors=("timeout",)),  # one of two calls failed: the other succeeded
    ]
    bonus = tool_bonus_rewards(trajectories, 0.25)
    assert bonus.dtype == torch.float32 and bonus.shape == (7,)
    assert bonus.tolist() == [0.25, 0.0, 0.25, 0.0, 0.0, 0.0, 0.25]
    assert tool_bonus_rewards(trajectories, 0.0).tolist() == [0.0] * 7


# ---- the shaping: GRPO advantages see the bonus -------------------------------------------------------------------
def _shape(bonus: torch.Tensor | None) -> dict:
    rewards = RewardResult(rewards=torch.zeros(4), valid=torch.ones(4, dtype=torch.bool), sources={}, parts={},
                           metrics={})
    mask = torch.ones(4, 2, dtype=torch.bool)
    return shape_step(ExperienceSettings(n_samples_per_prompt=4), groups=[0, 0, 0, 0], rewards=rewards,
                      lengths=torch.full((4,), 2), max_new_tokens=2, mask=mask, log_probs=torch.zeros(4, 2),
                      ref_log_probs=None, values=None, reward_norm=None, kl_controller=None, world=single(),
                      bonus=bonus)


def test_a_group_of_equal_task_rewards_learns_to_call_only_through_the_bonus():
    control = _shape(None)
    assert torch.equal(control["advantages"], torch.zeros(4, 2))  # every sample failed alike: nothing to learn
    shaped = _shape(torch.tensor([0.5, 0.0, 0.0, 0.0]))
    assert shaped["seq_reward"].tolist() == [0.5, 0.0, 0.0, 0.0]
    adv = shaped["advantages"][:, 0]
    # GRPO: (r - mean) / (std + eps) with the unbiased std of [0.5, 0, 0, 0] (0.25): 1.5 for the caller, -0.5 else
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    assert torch.equal(shaped["advantages"][:, 0], shaped["advantages"][:, 1])  # broadcast over its tokens


# ---- the maker: the step anneals it, the rollout must hold trajectories -------------------------------------------
def _rows(trajectories: list, *, single_turn: bool = False) -> Rollout:
    """Rows that hold only what the bonus reads (a single-turn rollout keeps no trajectories)."""
    n = len(trajectories)
    empty = [[] for _ in range(n)]
    return Rollout(list(range(n)), [0] * n, empty, empty, empty, [True] * n, [{}] * n, [""] * n, [None] * n,
                   [None] * n, empty, [None] * n, [] if single_turn else [[1]] * n,
                   [] if single_turn else trajectories)


def _bonus_of(settings: ExperienceSettings, rows: Rollout, step: int | None):
    return FastExperienceMaker._tool_bonus(SimpleNamespace(settings=settings), rows, step)


def test_the_maker_pays_the_steps_bonus_and_logs_it():
    on = ExperienceSettings(tool_bonus=0.5, tool_bonus_steps=10)
    rows = _rows([_trajectory(1), _trajectory(0), _trajectory(1)])
    bonus, metrics = _bonus_of(on, rows, 4)
    assert torch.equal(bonus, torch.tensor([0.3, 0.0, 0.3]))  # 0.5 * (1 - 4 / 10)
    assert metrics == {"agent/tool_bonus": 0.5 * (1 - 4 / 10), "agent/tool_bonus/paid_count": 2.0}
    bonus, metrics = _bonus_of(on, rows, 10)
    assert bonus.tolist() == [0.0, 0.0, 0.0] and metrics["agent/tool_bonus"] == 0.0
    assert _bonus_of(ExperienceSettings(), rows, 4) == (None, {})  # off: the shaping is untouched
    with pytest.raises(ValueError, match=r"experiences_from\(step=\.\.\.\)"):
        _bonus_of(on, rows, None)
    with pytest.raises(ValueError, match="single-turn"):
        _bonus_of(on, _rows([_trajectory(1)], single_turn=True), 4)


# ---- the config ---------------------------------------------------------------------------------------------------
def test_the_recipe_reaches_the_maker_settings_and_is_off_by_default():
    default = load_config("examples/agent_zoom_toy_cpu.yaml", [])
    assert (default.agent.tool_bonus, default.agent.tool_bonus_steps) == (0.0, None)
    on = load_config("examples/agent_zoom_toy_cpu.yaml", ["agent.tool_bonus=0.2", "agent.tool_bonus_steps=60"])
    settings = experience_settings(on.algorithm, on.rollout, on.trainer, agent=on.agent)
    assert (settings.tool_bonus, settings.tool_bonus_steps) == (0.2, 60)
    plain = experience_settings(on.algorithm, on.rollout, on.trainer)  # no agent section: no bonus
    assert (plain.tool_bonus, plain.tool_bonus_steps) == (0.0, None)


@pytest.mark.parametrize("agent, match", [
    ({"tools": ["image_zoom"], "tool_bonus": -0.1}, r"agent\.tool_bonus"),
    ({"tools": ["image_zoom"], "tool_bonus": float("inf")}, r"agent\.tool_bonus"),
    ({"tools": ["image_zoom"], "tool_bonus": 0.5, "tool_bonus_steps": 0}, r"agent\.tool_bonus_steps"),
    ({"tools": ["image_zoom"], "tool_bonus_steps": 60}, r"agent\.tool_bonus_steps anneals agent\.tool_bonus"),
    ({"environment": "mmrlhf.agents.example_env:GuessNumber", "tool_bonus": 0.5}, r"agent\.tool_bonus .*agent\.tools"),
    ({"tool_bonus": 0.5}, r"agent\.tool_bonus .*agent\.tools"),
])
def test_invalid_bonus_settings_name_the_key(agent, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        build_config({"agent": agent})
    build_config({"agent": {"tools": ["image_zoom"], "tool_bonus": 0.5, "tool_bonus_steps": 60}})  # the control
