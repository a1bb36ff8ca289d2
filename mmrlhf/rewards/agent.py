"""Rewards that read the whole multi-turn trajectory of a tool-using rollout, not only its final answer.

The contract is the plugin one (``fn(responses, prompts, labels, references, **columns)``) plus one column: a
function that declares the keyword ``trajectories`` receives one :class:`~mmrlhf.agents.types.Trajectory` per sample
(``None`` for a single-turn sample), and ``responses`` are then the FINAL assistant message of each trajectory.

Why tool bonuses here are gated on a correct answer: a bonus paid for calling a tool, whatever the outcome, is
learnt as "call the tool" (DeepEyes' ablation: an unconditional tool reward gave frequent calls and low accuracy;
no tool reward at all made the policy stop calling). Paying it only when the answer is right rewards the calls
that helped solve the task.

Correctness is rule-based (:func:`answer_is_correct`, built on :mod:`mmrlhf.rewards.rules`): free-form references
(sentences) need a judge instead; put a remote or model source next to these functions in the recipe.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Union

from mmrlhf.agents.types import Trajectory
from mmrlhf.rewards.rules import extract_answer, extract_choice, is_think_answer_format, normalize_text, parse_number

CorrectFn = Union[str, Callable[[str, Any], bool]]
MATCH_MODES = ("auto", "exact", "choice", "numeric")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
# Failures of calls that were parsed and ran (their tool raised, hung, or returned an image or a text that was
# refused); the other kinds (bad_json, unknown_tool, bad_arguments, too_many_calls) are refused while parsing and
# never become a call in ``Trajectory.tool_calls`` (see mmrlhf.agents.calls and mmrlhf.agents.types.ERROR_KINDS).
_RUN_FAILURES = ("tool_raised", "timeout", "image_too_large", "text_too_long", "too_many_images")


# ---- per-sample helpers ----------------------------------------------------------------------------------------
def answer_is_correct(response: str, reference: Any, match: str = "auto", rel_tol: float = 1e-4) -> bool:
    """Whether the final answer of ``response`` (its last ``<answer>`` block, else last ``\\boxed{}``, else all of
    it) matches ``reference``.

    ``match``: ``exact`` (equal after :func:`~mmrlhf.rewards.rules.normalize_text`), ``choice`` (same option
    letter), ``numeric`` (last numbers within ``rel_tol``), or ``auto``: ``choice`` when the reference names an
    option letter, ``numeric`` when it is a plain number, else ``exact``.

    >>> answer_is_correct("<think>zoomed</think><answer>(B) red</answer>", "B")
    True
    >>> answer_is_correct("<answer>1,200</answer>", "1200")
    True
    >>> answer_is_correct("<answer>The  Flag is WHITE.</answer>", "the flag is white")
    True
    >>> answer_is_correct("<answer>white</answer>", "The color of the flag is white.")  # a sentence needs a judge
    False
    """
    if match not in MATCH_MODES:
        raise ValueError(f"unknown match mode {match!r}; expected one of {', '.join(MATCH_MODES)}")
    gold = str(reference).strip()
    answer = extract_answer(response)
    if match == "auto":
        if extract_choice(gold) is not None:
            match = "choice"
        elif _PLAIN_NUMBER.fullmatch(gold):
            match = "numeric"
        else:
            match = "exact"
    if match == "choice":
        letter = extract_choice(gold)
        if letter is None:
            raise ValueError(f"reference {gold!r} names no option letter (match='choice')")
        return extract_choice(answer) == letter
    if match == "numeric":
        want = parse_number(gold)
        if want is None:
            raise ValueError(f"reference {gold!r} contains no number (match='numeric')")
        got = parse_number(answer)
        return got is not None and math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-8)
    return normalize_text(answer) == normalize_text(gold)


def successful_tool_calls(trajectory: Trajectory | None) -> int:
    """Tool calls of the trajectory that were answered without an error (0 for a single-turn sample).

    Every parsed call gets exactly one result; a block refused while parsing (bad JSON, an unknown tool, bad
    arguments, past the call limit) never became a call, so only the failures of calls that ran are subtracted.
    """
    if trajectory is None:
        return 0
    failed_calls = sum(kind in _RUN_FAILURES for kind in trajectory.errors)
    return max(0, trajectory.num_tool_calls - failed_calls)


def _judge(correct_fn: CorrectFn) -> Callable[[str, Any], bool]:
    if callable(correct_fn):
        return lambda response, reference: bool(correct_fn(response, reference))
    if correct_fn not in MATCH_MODES:
        raise ValueError(f"correct_fn must be a callable (response, reference) -> bool or one of "
                         f"{', '.join(MATCH_MODES)}; got {correct_fn!r}")
    return lambda response, reference: answer_is_correct(response, reference, correct_fn)


def _trajectories(trajectories: list[Trajectory | None] | None, n: int) -> list[Trajectory | None]:
    """One trajectory (or None) per sample; a wrong count or type is an error naming it (never misaligned)."""
    if trajectories is None:
        return [None] * n
    items = list(trajectories)
    if len(items) != n:
        raise ValueError(f"got {len(items)} trajectories for {n} responses")
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, Trajectory):
            raise TypeError(f"trajectories[{i}] is a {type(item).__name__}, expected mmrlhf.agents.types.Trajectory "
                            "or None")
    return items


def _finite(name: str, value: float, *, non_negative: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or (non_negative and value < 0):
        raise ValueError(f"{name} must be a finite{' non-negative' if non_negative else ''} number, got {value}")
    return value


# ---- reward functions ------------------------------------------------------------------------------------------
def tool_use_bonus(
    responses: list[str],
    prompts: list[str],
    labels: list[str],
    references: list[Any],
    *,
    trajectories: list[Trajectory | None] | None = None,
    bonus: float = 1.0,
    error_penalty: float = 0.0,
    correct_fn: CorrectFn = "auto",
) -> list[float | None]:
    """``bonus`` when the final answer is correct AND at least one tool call succeeded; minus ``error_penalty``
    when any tool call of the trajectory failed (bad JSON, unknown tool, bad arguments, timeout, ...), whatever the
    answer. None without a reference (correctness cannot be judged); 0 for a single-turn sample (no tool used).

    ``correct_fn``: a match mode of :func:`answer_is_correct` (``auto``, ``exact``, ``choice``, ``numeric``) or,
    from Python, a callable ``(response, reference) -> bool``. Meant as an add-on term next to an accuracy source
    in a label's recipe.
    """
    del prompts, labels  # scored from the final answer and the trajectory only
    bonus = _finite("bonus", bonus, non_negative=True)
    error_penalty = _finite("error_penalty", error_penalty, non_negative=True)
    judge = _judge(correct_fn)
    scores: list[float | None] = []
    for response, reference, trajectory in zip(responses, references, _trajectories(trajectories, len(responses))):
        if reference is None:
            scores.append(None)
            continue
        score = bonus if successful_tool_calls(trajectory) > 0 and judge(response, reference) else 0.0
        if trajectory is not None and trajectory.errors:
            score -= error_penalty
        scores.append(score)
    return scores


def deepeyes_reward(
    responses: list[str],
    prompts: list[str],
    labels: list[str],
    references: list[Any],
    *,
    trajectories: list[Trajectory | None] | None = None,
    accuracy_weight: float = 0.8,
    format_weight: float = 0.2,
    tool_weight: float = 1.2,
    correct_fn: CorrectFn = "auto",
    max_answer_chars: int = 1000,
) -> list[dict[str, float] | None]:
    """DeepEyes-style score: ``accuracy_weight * accuracy + format_weight * (format - 1) + tool_weight * tool``.

    Parts (each logged as ``reward/<source>/<part>/mean``):

    - ``accuracy``: 1 if the final answer matches the reference (:func:`answer_is_correct` with ``correct_fn``),
      and the answer is shorter than ``max_answer_chars`` characters;
    - ``format``: 1 if the final turn is ``<think>...</think><answer>...</answer>`` (each tag once, non-empty
      answer, shorter than ``max_answer_chars``) and no tool call of the trajectory failed, else 0: the overall
      subtracts ``format_weight`` for a malformed trajectory and adds nothing for a well-formed one;
    - ``tool``: 1 if the answer is correct AND at least one tool call succeeded, else 0.

    So with the defaults the overall ranges from -0.2 (wrong, malformed) over 0.8 (right, no tool) to 2.0 (right,
    with a successful tool call). None without a reference; a single-turn sample (``None`` trajectory) is scored on
    its response and gets no tool term.

    What was taken from DeepEyes (github.com/Visual-Agent/DeepEyes, ``verl/utils/reward_score/vl_agent.py``,
    ``compute_score``, used for its V* and chart data): the weights 0.8 (accuracy), 0.2 (format, a penalty: 0 when
    well formed, -1 when not) and 1.2 (tool, paid only when the accuracy is above 0.5 and the trajectory contains
    at least one tool-returned image); an answer of 1000 characters or more scores accuracy 0 and counts as a
    format error. Their format error is unbalanced ``<think>`` / ``</think>``, image, or ``<answer>`` tags over the
    whole output; here the final turn must follow the strict think/answer format and earlier turns must not have
    failed tool calls. Their tool term counts images returned into the trajectory; here a tool call answered
    without an error counts (for the zoom tool, the same thing). Their accuracy is an LLM judge's verdict (Qwen2.5-72B-Instruct); here it is rule-based. For
    their ThinkLite math rows DeepEyes uses 1.2 x accuracy + 0.4 x format and no tool term (``tool_weight=0``,
    ``accuracy_weight=1.2``, ``format_weight=0.4`` here).
    """
    del prompts, labels
    accuracy_weight = _finite("accuracy_weight", accuracy_weight)
    format_weight = _finite("format_weight", format_weight)
    tool_weight = _finite("tool_weight", tool_weight)
    if int(max_answer_chars) < 1:
        raise ValueError(f"max_answer_chars must be at least 1, got {max_answer_chars}")
    judge = _judge(correct_fn)
    out: list[dict[str, float] | None] = []
    for response, reference, trajectory in zip(responses, references, _trajectories(trajectories, len(responses))):
        if reference is None:
            out.append(None)
            continue
        short = len(extract_answer(response)) < max_answer_chars
        accuracy = 1.0 if short and judge(response, reference) else 0.0
        clean_calls = trajectory is None or not trajectory.errors
        well_formed = 1.0 if short and clean_calls and is_think_answer_format(response) else 0.0
        tool = 1.0 if accuracy > 0.5 and successful_tool_calls(trajectory) > 0 else 0.0
        overall = accuracy_weight * accuracy + format_weight * (well_formed - 1.0) + tool_weight * tool
        out.append({"overall": overall, "accuracy": accuracy, "format": well_formed, "tool": tool})
    return out
