"""The reward-function registry: every built-in rule reward listed in one place, and loading a function by name.

Why one list here rather than decorators in the rule modules: registering through an import side effect made the
rule modules import the registry and the registry import them back (a circle), and a name resolved only after
something happened to import the right module. Here importing this module is what makes the names exist, and the
rule modules stay plain functions that know nothing of the registry. Importing them is cheap: math-verify (and
sympy) load on the first ``math_accuracy`` call, not here.

Names of the form ``package.module:fn`` and ``path/to/file.py:fn`` resolve through the registry too (by import), so
user functions need no registration.
"""

from __future__ import annotations

from typing import Any, Callable

from mmrlhf.registry import Registry
from mmrlhf.rewards.agent import deepeyes_reward, tool_use_bonus
from mmrlhf.rewards.math_accuracy import math_accuracy
from mmrlhf.rewards.rules import boxed_format, exact_match, multiple_choice, numeric_match, think_answer_format
from mmrlhf.rewards.types import RewardError


def _with_builtins() -> Registry[Callable[..., Any]]:
    registry: Registry[Callable[..., Any]] = Registry("reward function")
    registry.add("think_answer_format", think_answer_format, aliases=("format",))
    registry.add("boxed_format", boxed_format)
    registry.add("exact_match", exact_match)
    registry.add("numeric_match", numeric_match, aliases=("numeric",))
    registry.add("multiple_choice", multiple_choice, aliases=("mcq",))
    registry.add("math_accuracy", math_accuracy, aliases=("math",))
    registry.add("tool_use_bonus", tool_use_bonus)
    registry.add("deepeyes_reward", deepeyes_reward, aliases=("deepeyes",))
    return registry


REWARD_FUNCTIONS = _with_builtins()
"""Built-in rule rewards by name; ``package.module:fn`` and ``path/to/file.py:fn`` resolve through it too."""


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function registered as ``spec``, or imported from ``module:fn`` / ``file.py:fn``; it must be callable."""
    fn = REWARD_FUNCTIONS.get(spec)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r} resolved to a non-callable {type(fn).__name__}")
    return fn
