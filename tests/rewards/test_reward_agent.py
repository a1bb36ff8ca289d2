"""Trajectory-aware rewards on hand-built trajectories: the tool term pays only for a correct answer reached with a
successful call, tool failures cost the format term (or the configured penalty), single-turn samples score on their
response, and the engine hands a ``trajectories`` column to the functions that declare it."""

from __future__ import annotations

import doctest

import pytest

import mmrlhf.rewards.agent
from mmrlhf.agents.types import ToolCall, Trajectory, TurnRecord
from mmrlhf.config import build_config
from mmrlhf.rewards import RewardBatch, RewardComputationEngine, load_reward_function
from mmrlhf.rewards.agent import answer_is_correct, deepeyes_reward, successful_tool_calls, tool_use_bonus

RIGHT = "<think>the zoomed crop shows a white flag</think><answer>B</answer>"
WRONG = "<think>looks red to me</think><answer>A</answer>"
ZOOM = ToolCall("image_zoom", {"bbox_2d": [10, 10, 80, 80], "image_index": 0, "label": "flag"})


def trajectory(final: str, turns: list[list[str]] = (), ended: str = "answer") -> Trajectory:
    """A trajectory with one assistant turn per entry of ``turns``, then the final turn ``final``. An entry lists
    the outcome of each tool block of that turn: ``"ok"`` (a call that returned a crop) or a failure kind. As the
    parser does, only "ok" and the failures of calls that ran (tool_raised, timeout, image_too_large,
    text_too_long, too_many_images) are calls; a block refused while parsing (bad_json, unknown_tool, bad_arguments,
    too_many_calls) is not."""
    ran = ("ok", "tool_raised", "timeout", "image_too_large", "text_too_long", "too_many_images")
    records: list[TurnRecord] = []
    for outcomes in turns:
        calls = [ZOOM for outcome in outcomes if outcome in ran]
        records.append(TurnRecord("assistant", text="<think>zoom</think><tool_call>...</tool_call>", calls=calls))
        records.append(TurnRecord("tool", images=["<a PIL crop>"] * outcomes.count("ok"),
                                  errors=[outcome for outcome in outcomes if outcome != "ok"]))
    records.append(TurnRecord("assistant", text=final))
    return Trajectory(turns=records, final_answer=final, ended=ended)


def score(fn, responses, references, trajectories, **options):
    n = len(responses)
    return fn(responses, [""] * n, ["deepeyes"] * n, references, trajectories=trajectories, **options)


def test_doctests_run_and_pass():
    result = doctest.testmod(mmrlhf.rewards.agent, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_deepeyes_reward_pays_the_tool_term_only_for_a_correct_answer_with_a_successful_call():
    cases = {
        "correct with tool": (RIGHT, trajectory(RIGHT, [["ok"]])),
        "correct without tool": (RIGHT, trajectory(RIGHT)),
        "wrong with tool": (WRONG, trajectory(WRONG, [["ok"], ["ok"]])),
        "wrong without tool": (WRONG, trajectory(WRONG)),
    }
    out = score(deepeyes_reward, [r for r, _ in cases.values()], ["B"] * 4, [t for _, t in cases.values()])
    got = {name: part for name, part in zip(cases, out)}
    assert got["correct with tool"] == {"overall": pytest.approx(2.0), "accuracy": 1.0, "format": 1.0, "tool": 1.0}
    assert got["correct without tool"] == {"overall": pytest.approx(0.8), "accuracy": 1.0, "format": 1.0, "tool": 0.0}
    # the control: calling twice and answering wrong earns nothing over answering wrong without a call
    assert got["wrong with tool"] == {"overall": pytest.approx(0.0), "accuracy": 0.0, "format": 1.0, "tool": 0.0}
    assert got["wrong without tool"]["overall"] == got["wrong with tool"]["overall"]


def test_tool_use_bonus_is_gated_on_correctness():
    trajs = [trajectory(RIGHT, [["ok"]]), trajectory(RIGHT), trajectory(WRONG, [["ok"], ["ok"], ["ok"]])]
    assert score(tool_use_bonus, [RIGHT, RIGHT, WRONG], ["B"] * 3, trajs, bonus=0.5) == [0.5, 0.0, 0.0]


def test_tool_errors_cost_the_format_term_and_the_optional_penalty():
    partly_failed = trajectory(RIGHT, [["timeout"], ["ok"]])  # one call that hung, then one that returned a crop
    all_failed = trajectory(RIGHT, [["timeout"], ["tool_raised"]])
    refused_then_ok = trajectory(RIGHT, [["bad_json", "bad_arguments", "ok"]])
    assert successful_tool_calls(partly_failed) == 1
    assert successful_tool_calls(all_failed) == 0
    assert successful_tool_calls(trajectory(RIGHT, [["text_too_long"], ["ok"]])) == 1  # a refused text: it failed
    assert successful_tool_calls(refused_then_ok) == 1  # refused blocks never became calls: the good call counts

    out = score(deepeyes_reward, [RIGHT] * 3, ["B"] * 3, [partly_failed, all_failed, refused_then_ok])
    assert [o["format"] for o in out] == [0.0, 0.0, 0.0]
    assert [o["tool"] for o in out] == [1.0, 0.0, 1.0]
    assert [o["overall"] for o in out] == pytest.approx([1.8, 0.6, 1.8])  # 0.8 - 0.2 (+ 1.2 with a good call)

    bonus = score(tool_use_bonus, [RIGHT, RIGHT, WRONG], ["B"] * 3,
                  [partly_failed, all_failed, trajectory(WRONG, [["unknown_tool"]])], bonus=1.0, error_penalty=0.25)
    assert bonus == pytest.approx([0.75, -0.25, -0.25])  # the penalty applies whatever the answer
    assert score(tool_use_bonus, [RIGHT], ["B"], [partly_failed]) == [1.0]  # no penalty unless configured


def test_single_turn_samples_score_on_their_response_without_a_tool_term():
    out = score(deepeyes_reward, [RIGHT, WRONG, "B"], ["B", "B", "B"], [None, None, None])
    assert [o["overall"] for o in out] == pytest.approx([0.8, 0.0, 0.6])  # "B" alone: right, but not formatted
    assert [o["tool"] for o in out] == [0.0, 0.0, 0.0]
    assert score(deepeyes_reward, [RIGHT], ["B"], None) == out[:1]  # no trajectories column at all: the same
    assert score(tool_use_bonus, [RIGHT, RIGHT], ["B", "B"], [None, trajectory(RIGHT, [["ok"]])]) == [0.0, 1.0]


def test_budget_endings_and_overlong_answers_score_as_failures():
    cut = "<think>I need a closer look</think><tool_call>{\"name\": \"image_zoom\", "
    out = score(deepeyes_reward, [cut], ["B"], [trajectory(cut, [["ok"]], ended="max_turns")])
    assert out == [{"overall": pytest.approx(-0.2), "accuracy": 0.0, "format": 0.0, "tool": 0.0}]
    padded = "<think>t</think><answer>B. " + "it is white " * 100 + "</answer>"  # picks B, in 1200 characters
    assert answer_is_correct(padded, "B")
    long = score(deepeyes_reward, [padded], ["B"], [trajectory(padded, [["ok"]])], max_answer_chars=1000)[0]
    assert (long["accuracy"], long["format"], long["tool"]) == (0.0, 0.0, 0.0)


def test_without_a_reference_nothing_applies():
    assert score(deepeyes_reward, [RIGHT], [None], [trajectory(RIGHT, [["ok"]])]) == [None]
    assert score(tool_use_bonus, [RIGHT], [None], [trajectory(RIGHT, [["ok"]])]) == [None]


def test_weights_and_correctness_are_configurable():
    math_row = score(deepeyes_reward, [RIGHT, WRONG], ["B", "B"], [trajectory(RIGHT, [["ok"]]), trajectory(WRONG)],
                     accuracy_weight=1.2, format_weight=0.4, tool_weight=0.0)  # DeepEyes' ThinkLite weights
    assert [o["overall"] for o in math_row] == pytest.approx([1.2, 0.0])
    numbers = "<think>t</think><answer>about 12.0 apples</answer>"
    assert score(deepeyes_reward, [numbers], ["12"], [None])[0]["accuracy"] == 1.0
    assert score(deepeyes_reward, [numbers], ["12"], [None], correct_fn="exact")[0]["accuracy"] == 0.0
    judged = score(tool_use_bonus, [WRONG], ["B"], [trajectory(WRONG, [["ok"]])], correct_fn=lambda r, ref: True)
    assert judged == [1.0]


@pytest.mark.parametrize("options, message", [
    ({"correct_fn": "fuzzy"}, "correct_fn must be"),
    ({"bonus": -1.0}, "bonus must be a finite non-negative"),
    ({"error_penalty": float("nan")}, "error_penalty must be"),
])
def test_bad_options_are_refused_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        score(tool_use_bonus, [RIGHT], ["B"], [None], **options)


def test_misaligned_or_mistyped_trajectories_are_errors():
    with pytest.raises(ValueError, match="got 1 trajectories for 2 responses"):
        score(deepeyes_reward, [RIGHT, RIGHT], ["B", "B"], [None])
    with pytest.raises(TypeError, match=r"trajectories\[0\] is a dict"):
        score(deepeyes_reward, [RIGHT], ["B"], [{"turns": []}])
    with pytest.raises(ValueError, match="names no option letter"):
        answer_is_correct(RIGHT, "white", match="choice")


def test_registered_names_and_the_engine_pass_trajectories_and_log_parts():
    assert load_reward_function("deepeyes_reward") is deepeyes_reward
    assert load_reward_function("deepeyes") is deepeyes_reward
    assert load_reward_function("tool_use_bonus") is tool_use_bonus
    config = build_config({"reward": {
        "label_map": {"eyes": "deepeyes_reward", "bonus": {"type": "function", "function": "tool_use_bonus",
                                                            "options": {"bonus": 0.5}}},
        "recipe": {"deepeyes": [["eyes", 1.0]], "other": [["bonus", 1.0]]},
    }})
    engine = RewardComputationEngine.from_config(config.reward)
    trajs = [trajectory(RIGHT, [["ok"]]), trajectory(WRONG, [["ok"]]), trajectory(RIGHT, [["ok"]])]
    result = engine.compute(RewardBatch(responses=[RIGHT, WRONG, RIGHT], prompts=[""] * 3,
                                        labels=["deepeyes", "deepeyes", "other"], references=["B", "B", "B"],
                                        extra={"trajectories": trajs}))
    assert result.rewards.tolist() == pytest.approx([2.0, 0.0, 0.5])
    assert result.parts["eyes/tool"].tolist()[:2] == [1.0, 0.0]
    assert result.parts["eyes/accuracy"].tolist()[:2] == [1.0, 0.0]
