"""Built-in rule rewards: doctests actually run, response-only scoring, matching edge cases."""

from __future__ import annotations

import doctest

import pytest

import mmrlhf.rewards.local_model
import mmrlhf.rewards.math_accuracy
import mmrlhf.rewards.rules
from mmrlhf.config import build_config
from mmrlhf.rewards import RewardBatch, RewardComputationEngine, load_reward_function


@pytest.mark.parametrize("module", [mmrlhf.rewards.rules, mmrlhf.rewards.math_accuracy, mmrlhf.rewards.local_model])
def test_doctests_run_and_pass(module):
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def call(name, responses, references=None, prompts=None, **options):
    n = len(responses)
    fn = load_reward_function(name)
    return fn(responses, prompts or [""] * n, ["L"] * n, references or [None] * n, **options)


def test_format_is_judged_on_the_response_only_even_if_the_prompt_opens_the_think_block():
    prompt = "Solve it. <|im_start|>assistant\n<think>"
    response = "the sum is 4</think><answer>4</answer>"
    assert (prompt + response).count("<think>") == 1  # prompt + response WOULD look well formatted
    assert call("think_answer_format", [response], prompts=[prompt]) == [0.0]
    # and through the engine, which hands prompt and response separately
    config = build_config({"reward": {"label_map": {"fmt": "think_answer_format"}, "recipe": {"r1": [["fmt", 1.0]]}}})
    engine = RewardComputationEngine.from_config(config.reward)
    batch = RewardBatch(
        responses=[response, "<think>s</think><answer>4</answer>"], prompts=[prompt, prompt], labels=["r1", "r1"],
        references=[None, None],
    )
    assert engine.compute(batch).rewards.tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    "response, ok",
    [
        ("<think>x</think>\n<answer>y</answer>\n", True),
        ("<think>x</think><answer>y</answer><answer>z</answer>", False),
        ("<think>x<think>y</think><answer>z</answer>", False),
        ("<answer>y</answer><think>x</think>", False),
        ("<think>x</think>", False),
        ("", False),
    ],
)
def test_think_answer_format_cases(response, ok):
    assert call("think_answer_format", [response]) == [float(ok)]


def test_boxed_format_needs_a_closed_non_empty_box():
    assert call("boxed_format", [r"so \boxed{x^{2}}", r"\boxed{", r"\boxed{}", "42"]) == [1.0, 0.0, 0.0, 0.0]


def test_exact_match_normalizes_and_skips_samples_without_reference():
    out = call("exact_match", ["<answer> The Eiffel  Tower. </answer>", "<answer>Louvre</answer>", "x"],
               ["the eiffel tower", "Eiffel Tower", None])
    assert out == [1.0, 0.0, None]


def test_numeric_match_tolerance_option_and_bad_reference():
    responses = ["<answer>3.1416</answer>", r"\boxed{1,000}", "no number", "<answer>-2/4</answer>"]
    assert call("numeric_match", responses, ["3.14159", "1000", "5", "-0.5"]) == [1.0, 1.0, 0.0, 1.0]
    assert call("numeric_match", ["3.2"], ["3.14159"], rel_tol=0.05) == [1.0]
    assert call("numeric_match", ["3.2"], ["3.14159"]) == [0.0]
    with pytest.raises(ValueError, match="reference 'n/a' contains no number"):
        call("numeric_match", ["3"], ["n/a"])


def test_multiple_choice_reads_the_letter_from_the_answer_not_the_prompt():
    out = call(
        "multiple_choice",
        ["<answer>(C)</answer>", "The answer is b", "<answer>Banana</answer>", "<answer>E</answer>"],
        ["C", "(B)", "B", "D"],
        prompts=["(B)", "(B)", "Answer: B", "D"],
        letters="ABCD",
    )
    assert out == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="reference 'E' is not one of the option letters 'ABCD'"):
        call("multiple_choice", ["E"], ["E"], letters="ABCD")


def test_math_accuracy_equivalent_forms_and_no_reference():
    out = call(
        "math_accuracy",
        [r"<think>.</think><answer>\frac{3}{4}</answer>", r"so \boxed{0.75}", "<answer>3/5</answer>", "7", "x"],
        ["0.75", r"\frac34", "0.75", "7", None],
    )
    assert out == [1.0, 1.0, 0.0, 1.0, None]


def test_math_accuracy_ignores_a_correct_answer_that_only_the_prompt_contains():
    prompt = r"Hint: the answer is \boxed{12}."
    assert call("math_accuracy", ["I do not know"], ["12"], prompts=[prompt]) == [0.0]


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is a cat", None),  # article, not option A
        ("the answer is a bit tricky, but it is C", "C"),
        ("the answer is A or B", None),  # a hedge picks no single option
        ("Answer: (B)", "B"),
        ("I think the answer is D. It could not be A.", "D"),  # the clause after the keyword decides
        ("The option is I", None),  # not one of the letters
    ],
)
def test_extract_choice_rejects_false_positives(response, expected):
    from mmrlhf.rewards.rules import extract_choice, multiple_choice

    assert extract_choice(response) == expected
    if expected is None:
        assert multiple_choice([response], ["q"], ["mcq"], ["A"]) == [0.0]


def test_answer_rules_read_the_answer_after_a_thinking_block():
    """Qwen3.5's thinking template opens ``<think>`` in the prompt: the answer is what follows the response's
    ``</think>``, a candidate inside the reasoning does not count, and an unfinished block has no answer. Without a
    block (non-thinking mode, older families) the whole response is the answer, as before."""
    thinking = "<|im_start|>assistant\n<think>\n"
    direct = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    refs = ["4", "4", "4", "4"]
    responses = ["maybe \\boxed{3}</think>\n\n\\boxed{4}", "maybe 4</think>\n\n3", "4 is what I think", "\\boxed{4}"]
    prompts = [thinking, thinking, thinking, direct]
    assert call("numeric_match", responses, prompts=prompts, references=refs) == [1.0, 0.0, 0.0, 1.0]
    assert call("math_accuracy", responses, prompts=prompts, references=refs) == [1.0, 0.0, 0.0, 1.0]
    assert call("exact_match", ["x</think> B"], prompts=[thinking], references=["b"]) == [1.0]
    assert call("numeric_match", ["4"], references=["4"]) == [1.0]  # no prompt, no block: the whole response


def test_the_toy_task_reads_the_first_word_after_the_thinking_block():
    from mmrlhf.tasks.shapes import first_word_reward

    prompts = ["<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n<think>\n", ""]
    assert first_word_reward([" red", "blue</think> red", "red"], prompts, ["L"] * 3, ["red"] * 3) == [1.0, 1.0, 1.0]
    assert first_word_reward(["red, I think"], ["<|im_start|>assistant\n<think>\n"], ["L"], ["red"]) == [0.0]
