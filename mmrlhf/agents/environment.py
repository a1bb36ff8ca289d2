"""Interactive environments (``agent.environment``): instead of tools, an object that answers every policy turn.

One environment object serves one trajectory: the rollout makes it with the factory :func:`load_environment`
returns, calls ``reset(record)`` once (its return value, if not None, is the first observation, shown before the
first turn; a ``StepResult`` with ``done`` says the record has no episode to play), then ``step(action_text)`` with
the decoded text of each policy turn until a step says ``done`` or a budget ends the trajectory, then ``close()``
if the object has one. ``reset``, ``step`` and ``close`` may be ``async def``; the runner
(:meth:`mmrlhf.agents.runner.ToolRunner.run_environment_steps`) calls each under the tool deadline, and whatever
one raises (``BaseException`` included) is counted as that trajectory's failure.

A class that says ``reusable = True`` serves trajectory after trajectory in the asynchronous loop's pool, ``reset``
for each; but only while it is clean: one whose last ``reset`` or ``step`` failed (raised, timed out, returned what
the runner refused) is closed and never handed on, since its episode (or a call abandoned in its thread) may still
be the previous record's. ``close()`` can then run while such an abandoned call is still inside the object: for a
backend, closing is what stops it, and the rollout never waits for an abandoned call (a close that blocks is held to
the deadline, counted as a ``timeout``).

Example: :class:`mmrlhf.agents.example_env.GuessNumber` (``agent.environment:
mmrlhf.agents.example_env:GuessNumber``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol, runtime_checkable

from mmrlhf.agents.types import FailedStep, StepResult, ToolResult
from mmrlhf.registry import check_options, import_object


class EnvironmentSpecError(ValueError):
    """An environment spec that does not resolve to something making environments; names the spec."""


@runtime_checkable
class Environment(Protocol):
    """What an environment provides (``close()`` is optional: see :func:`close_environment`)."""

    def reset(self, record: dict[str, Any]) -> ToolResult | StepResult | None:
        """Start the episode of dataset record ``record``; the first observation, or None for none (a StepResult
        with ``done``: there is no episode for this record, the trajectory ends before its first turn)."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Answer one policy turn (its decoded text): the next observation, whether the episode is over, info."""
        ...


def _check_environment(env: Any, spec: str) -> Environment:
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise EnvironmentSpecError(f"environment {spec!r} made a {type(env).__name__} without "
                                   f"{' / '.join(f'{m}()' for m in missing)}; an environment needs reset(record) and "
                                   "step(action_text)")
    return env


def load_environment(spec: str, options: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A factory making one environment per trajectory from ``package.module:Name`` or ``path/to/file.py:Name``:
    a class (instantiated with ``options``) or a factory function (called with ``options``). An instance is
    refused (trajectories would share its state). Options are checked against the signature here, once."""
    options = dict(options or {})
    if not isinstance(spec, str) or ":" not in spec:
        raise EnvironmentSpecError(f"environment {spec!r} must be 'package.module:Name' or 'path/to/file.py:Name'")
    target = import_object(spec)
    if not inspect.isclass(target) and callable(getattr(target, "step", None)):
        raise EnvironmentSpecError(f"environment {spec!r} is an instance; give its class or a factory so that each "
                                   "trajectory gets its own")
    if not callable(target):
        raise EnvironmentSpecError(f"environment {spec!r} resolved to a {type(target).__name__}, not a class or a "
                                   "factory function")
    if inspect.isclass(target):
        missing = [name for name in ("reset", "step") if not callable(getattr(target, name, None))]
        if missing:
            raise EnvironmentSpecError(f"environment {spec!r}: class {target.__name__} has no "
                                       f"{' / '.join(missing)} method; an environment needs reset(record) and "
                                       "step(action_text)")
    check_options(target, options, f"environment {spec!r}", error=EnvironmentSpecError)

    def make() -> Environment:
        return _check_environment(target(**options), spec)

    return make


class FailedEnvironment:
    """Stands in for the environment of one trajectory whose factory raised (a sandbox that did not start, a lost
    connection, a ``sys.exit`` in a constructor): its reset fails as a reset that raises does (``tool_raised``,
    the trajectory ends ``reset_failed`` before its first turn, counted). One trajectory's failed start never ends
    the step. (A factory that makes something without ``reset`` / ``step`` is a spec error instead, raised: it
    would fail every trajectory alike.)"""

    def __init__(self, message: str) -> None:
        self.message = message

    def reset(self, record: dict[str, Any]) -> FailedStep:
        return FailedStep(observation=ToolResult(text=self.message, error="tool_raised"))

    def step(self, action_text: str) -> StepResult:
        return StepResult(observation=ToolResult(text=""), done=True)


def close_environment(env: Any) -> None:
    """``env.close()`` when the environment has one (closing is optional)."""
    close = getattr(env, "close", None)
    if callable(close):
        close()
