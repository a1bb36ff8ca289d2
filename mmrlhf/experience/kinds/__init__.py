"""Rollout kinds: how a step's responses come about (``rollout.kind``), one class each behind the protocol of
:mod:`mmrlhf.experience.kinds.base`, resolved by name through :data:`ROLLOUT_KINDS` (``single_turn``, ``agent``) or
as ``package.module:Name`` / ``path/to/file.py:Name`` (the registry's own resolution, as tools and rewards).

The built-ins are listed here rather than registered by decorators in their modules, so importing this package is
what makes the names exist (no import side effect to remember, no circle).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from mmrlhf.experience.kinds.agent import AgentKind
from mmrlhf.experience.kinds.base import PROTOCOL_MEMBERS, Generated, KindSetup, RolloutCall, RolloutKind
from mmrlhf.experience.kinds.single_turn import PromptMismatchError, SingleTurn
from mmrlhf.registry import Registry, RegistryError, check_options

__all__ = [
    "ROLLOUT_KINDS", "AgentKind", "Generated", "KindSetup", "PromptMismatchError", "RolloutCall", "RolloutKind",
    "SingleTurn", "build_rollout_kind", "kind_class", "resolve_kind_name",
]

KEY = "rollout.kind"


def _with_builtins() -> Registry[type]:
    registry: Registry[type] = Registry("rollout kind")
    registry.add("single_turn", SingleTurn)
    registry.add("agent", AgentKind)
    return registry


ROLLOUT_KINDS = _with_builtins()
"""Built-in rollout kinds by name (classes); ``package.module:Name`` and ``path/to/file.py:Name`` resolve through it
too."""


def resolve_kind_name(kind: str, agent_enabled: bool) -> str:
    """``rollout.kind`` with ``auto`` decided: ``agent`` when the agent section configures tools or an environment."""
    if kind == "auto":
        return "agent" if agent_enabled else "single_turn"
    return kind


def kind_class(spec: str) -> type:
    """The kind class ``spec`` names, checked against the protocol (a class with ``multi_turn``, ``generate``,
    ``responses`` and ``after_rewards``). Errors name the key and the spec."""
    try:
        target = ROLLOUT_KINDS.get(spec)
    except RegistryError as exc:
        raise RegistryError(f"{KEY}: {exc}") from exc
    if not inspect.isclass(target):
        raise TypeError(f"{KEY}: {spec!r} resolved to a {type(target).__name__}; a rollout kind is a class "
                        "(see mmrlhf.experience.kinds.base)")
    missing = [m for m in PROTOCOL_MEMBERS if not hasattr(target, m)]
    if missing:
        raise TypeError(f"{KEY}: {spec!r} ({target.__name__}) is not a rollout kind: it lacks {', '.join(missing)} "
                        f"(a kind has {', '.join(PROTOCOL_MEMBERS)}; see mmrlhf.experience.kinds.base)")
    if not isinstance(target.multi_turn, bool):
        raise TypeError(f"{KEY}: {spec!r} ({target.__name__}).multi_turn must be a bool, got "
                        f"{type(target.multi_turn).__name__}")
    return target


def build_rollout_kind(spec: str, setup: KindSetup, options: Mapping[str, Any] | None = None) -> RolloutKind:
    """``Kind(setup, **options)`` for the kind ``spec`` names (``rollout.kind``, ``rollout.kind_options``)."""
    cls = kind_class(spec)
    options = dict(options or {})
    check_options(cls, options, f"{KEY} {spec!r} (rollout.kind_options)", args=(setup,), error=TypeError)
    return cls(setup, **options)
