"""Rewards see trajectories: a function that declares ``trajectories`` receives them through the reward engine,
one that does not is called exactly as for single-turn samples (on the final answer), and the out-of-budget rule
zeroes only the trajectories a budget ended."""

from __future__ import annotations

from mmrlhf.agents.types import ToolCall, Trajectory, TurnRecord
from mmrlhf.config.reward import RewardConfig
from mmrlhf.experience.agent_rows import zero_out_of_budget
from mmrlhf.rewards.engine import RewardComputationEngine
from mmrlhf.rewards.types import RewardBatch

def calls_made(responses, prompts, labels, references, *, trajectories=None):
    return [float(t.num_tool_calls) for t in trajectories]


def first_word(responses, prompts, labels, references):  # no trajectories keyword: called as for one turn
    return [float(r.split()[0] == ref) for r, ref in zip(responses, references)]


def _trajectory(calls: int, answer: str, ended: str = "answer") -> Trajectory:
    turns = []
    for _ in range(calls):
        turns += [TurnRecord("assistant", "<tool_call>...</tool_call>", calls=[ToolCall("image_zoom", {})]),
                  TurnRecord("tool", "zoomed")]
    turns.append(TurnRecord("assistant", answer))
    return Trajectory(turns=turns, final_answer=answer, ended=ended)


def _engine() -> RewardComputationEngine:
    cfg = RewardConfig.model_validate({
        "label_map": {"calls": {"type": "function", "function": f"{__file__}:calls_made"},
                      "first": {"type": "function", "function": f"{__file__}:first_word"}},
        "default_recipe": [["calls", 0.5], ["first", 1.0]]})
    return RewardComputationEngine.from_config(cfg)


def test_trajectory_functions_get_them_and_plain_functions_score_the_final_answer():
    trajectories = [_trajectory(2, "red"), _trajectory(0, "blue"), _trajectory(1, "green", ended="max_turns")]
    batch = RewardBatch(responses=[t.final_answer for t in trajectories], prompts=["p"] * 3,
                        labels=["default"] * 3, references=["red", "red", "green"], trajectories=trajectories)
    result = _engine().compute(batch)
    assert result.sources["calls"].tolist() == [2.0, 0.0, 1.0]  # read from the trajectories
    assert result.sources["first"].tolist() == [1.0, 0.0, 1.0]  # the final answers
    assert result.rewards.tolist() == [0.5 * 2 + 1.0, 0.0, 0.5 * 1 + 1.0]
    zero_out_of_budget(result, trajectories)
    assert result.rewards.tolist() == [2.0, 0.0, 0.0]  # only the trajectory ended by max_turns
    assert result.metrics["reward/out_of_budget_zeroed/count"] == 1.0
    assert result.valid.all()  # zeroed, not masked: running out still teaches
