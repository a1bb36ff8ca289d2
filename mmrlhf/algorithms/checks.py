"""Argument checks shared by the registries' entry points."""

from __future__ import annotations

import inspect
from typing import Callable


def check_params(fn: Callable, params: dict, what: str) -> None:
    """Raise a ValueError naming the accepted keywords when ``params`` holds one ``fn`` does not take.

    A plain TypeError from deep inside a call would not say which registry entry was misconfigured.
    """
    sig = inspect.signature(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = {n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(
            f"{what} does not take {', '.join(map(repr, unknown))}; it accepts: {', '.join(sorted(accepted))}"
        )
