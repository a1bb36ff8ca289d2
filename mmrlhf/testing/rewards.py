"""Rewards for tests and benchmarks that need a policy gradient from the very first step.

The toy task's own reward (:func:`mmrlhf.tasks.shapes.first_word_reward`) is almost always 0 for a fresh tiny model,
so a first step would train on all-zero advantages and compare nothing. A reward that differs between the samples
of every group gives GRPO a non-zero gradient at once. Referenced by import path (``mmrlhf.testing.rewards:...``)
so that every process of a run (torchrun ranks, Ray actors) can load it.
"""

from __future__ import annotations

from typing import Any, Sequence


def response_length_reward(responses: Sequence[str], prompts: Sequence[str], labels: Sequence[str],  # noqa: ARG001
                           references: Sequence[Any]) -> list[float]:  # noqa: ARG001
    """The response's character count / 10: varies inside almost every group of sampled responses."""
    return [len(r) / 10.0 for r in responses]


def partial_length_reward(responses: Sequence[str], prompts: Sequence[str], labels: Sequence[str],  # noqa: ARG001
                          references: Sequence[Any]) -> list[float | None]:  # noqa: ARG001
    """:func:`response_length_reward`, but None (does not apply: the sample is masked out of the loss) for about a
    third of the responses, picked by their first character. Data-parallel tests use it so that ranks hold
    different numbers of trained tokens, which is what tells a loss normalised over all ranks from one normalised
    per rank."""
    return [None if (r and ord(r[0]) % 3 == 0) else len(r) / 10.0 for r in responses]
