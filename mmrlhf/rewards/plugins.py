"""Reward-function plugins: calling them (sync or async) and checking what comes back (loading by name:
:mod:`mmrlhf.rewards.functions`).

The contract (see docs/rewards.md)::

    fn(responses, prompts, labels, references, **extra_columns) -> list[float | None | dict[str, float | None]]

One entry per sample, in order. ``None`` means "does not apply to this sample". A dict gives named parts
(``{"overall": 1.0, "format": 1.0, "accuracy": 0.0}``); the ``overall`` part is the score the recipe weighs (a dict
without it is an error, so a typo in the part name cannot silently become a zero reward), the others are logged.

Why the output is checked here rather than trusted: a wrong count would misalign every later sample's reward, and a
NaN would poison the advantage of its whole group. Both are turned into per-sample errors (or a whole-call error for
a wrong count) that the engine's failure policy handles in one place.

Where a function runs: an ``async def`` function on the event loop; a plain function in a worker thread of a
bounded pool (the engine's, or ``serve-reward``'s ``--threads``), so a slow rule never holds up remote requests or
other sources waiting on the loop; one marked ``@main_thread`` on the main thread (see ``mmrlhf.rewards.runners``).
A plain function may therefore run concurrently with OTHER functions, and on a server with several threads
concurrently with itself.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
from concurrent.futures import Executor
from typing import Any, Callable, Mapping

from mmrlhf.rewards.runners import MAIN_THREAD_ATTR, run_sync
from mmrlhf.rewards.types import RewardBatch, RewardError, SourceScores

logger = logging.getLogger(__name__)

OVERALL = "overall"


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine (``async def`` functions, partials of them, async ``__call__``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class WrongCountError(RewardError):
    """A reward function returned a number of scores different from the number of samples it was given."""


def function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _accepted_keywords(fn: Callable[..., Any]) -> set[str] | None:
    """Keyword names ``fn`` accepts, or None if it takes ``**kwargs`` (then it gets every extra column)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name for p in params if p.kind in named}


def build_kwargs(fn: Callable[..., Any], batch: RewardBatch, options: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Extra columns (plus ``images`` when present) the function declares, and the configured ``options``.

    Columns a function does not declare are not passed, so a rule function need not accept every dataset column;
    an option colliding with a column is an error rather than one value silently winning.
    """
    columns: dict[str, Any] = dict(batch.extra)
    if batch.images is not None:
        columns.setdefault("images", batch.images)
    if batch.trajectories is not None:  # multi-turn rollouts; a function without the keyword is not given them
        columns.setdefault("trajectories", batch.trajectories)
    clash = sorted(set(columns) & set(options))
    if clash:
        raise RewardError(f"reward function {name!r}: option(s) {clash} have the same name as data column(s)")
    accepted = _accepted_keywords(fn)
    if accepted is not None:
        columns = {k: v for k, v in columns.items() if k in accepted}
    return {**columns, **options}


async def _invoke(
    fn: Callable[..., Any], batch: RewardBatch, kwargs: dict[str, Any], executor: Executor | None
) -> Any:
    call = functools.partial(
        fn, list(batch.responses), list(batch.prompts), list(batch.labels), list(batch.references), **kwargs
    )
    if is_async_callable(fn):
        out = call()
    else:
        out = await run_sync(call, needs_main_thread=getattr(fn, MAIN_THREAD_ATTR, False), executor=executor)
    if inspect.isawaitable(out):
        out = await out
    return out


async def call_reward_function(
    fn: Callable[..., Any],
    batch: RewardBatch,
    *,
    name: str,
    options: Mapping[str, Any] | None = None,
    executor: Executor | None = None,
) -> SourceScores:
    """Call ``fn`` on the batch (awaiting it if async, else in a thread of ``executor``) and normalise its output.

    If the batched call raises, each sample is re-scored alone so that the failure lands on the sample(s) that
    caused it (and the others keep their scores); a wrong count raises :class:`WrongCountError`.
    """
    kwargs = build_kwargs(fn, batch, options or {}, name)
    try:
        raw = await _invoke(fn, batch, kwargs, executor)
    except Exception as exc:  # noqa: BLE001 - isolated below, never dropped
        if len(batch) == 1:
            message = f"{name!r} on {batch.describe(0)}: raised {type(exc).__name__}: {exc}"
            logger.warning("reward function %s", message, exc_info=exc)  # the traceback is kept in the log
            return SourceScores(scores=[None], errors=[message])
        logger.warning(
            "reward function %r raised %s on a batch of %d (%s ..); re-scoring sample by sample",
            name, type(exc).__name__, len(batch), batch.describe(0), exc_info=exc,
        )
        return await _call_one_by_one(fn, batch, name=name, options=options or {}, executor=executor)
    return normalize_output(raw, batch, name=name)


async def _call_one_by_one(
    fn: Callable[..., Any], batch: RewardBatch, *, name: str, options: Mapping[str, Any], executor: Executor | None
) -> SourceScores:
    pieces = [
        await call_reward_function(fn, batch.select([i]), name=name, options=options, executor=executor)
        for i in range(len(batch))
    ]
    return concat_scores(pieces)


def concat_scores(pieces: list[SourceScores]) -> SourceScores:
    """Concatenate per-chunk answers in order (a part missing from a chunk is None for its samples)."""
    names = sorted({p for piece in pieces for p in piece.parts})
    out = SourceScores(scores=[], parts={p: [] for p in names}, errors=[])
    for piece in pieces:
        n = len(piece.scores)
        out.scores.extend(piece.scores)
        out.errors.extend(piece.errors)
        for p in names:
            out.parts[p].extend(piece.parts.get(p, [None] * n))
    return out


def _as_score(value: Any) -> tuple[float | None, str | None]:
    """(score, error) for one returned value: None passes through; numbers must be finite reals."""
    if value is None:
        return None, None
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()  # 0-d tensor / numpy scalar
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None, f"returned a {type(value).__name__} ({value!r:.60}), expected a float, None or a dict"
    value = float(value)
    if not math.isfinite(value):
        return None, f"returned a non-finite score ({value})"
    return value, None


def normalize_output(raw: Any, batch: RewardBatch, *, name: str) -> SourceScores:
    """Check and convert a function's raw output for ``batch`` (see the module docstring for the contract)."""
    n = len(batch)
    if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__len__"):
        raise WrongCountError(
            f"reward function {name!r} returned a {type(raw).__name__}, expected a list of {n} scores "
            f"(for {batch.describe(0) if n else 'an empty batch'} ...)"
        )
    raw = list(raw)
    if len(raw) != n:
        first, last = (batch.describe(0), batch.describe(n - 1)) if n else ("-", "-")
        raise WrongCountError(
            f"reward function {name!r} returned {len(raw)} scores for {n} samples ({first} .. {last})"
        )
    scores: list[float | None] = []
    errors: list[str | None] = []
    parts: dict[str, list[float | None]] = {}
    for i, value in enumerate(raw):
        if isinstance(value, Mapping):
            score, error = _dict_entry(value, i, parts, n)
        else:
            score, error = _as_score(value)
        scores.append(score)
        errors.append(None if error is None else f"{name!r} on {batch.describe(i)}: {error}")
    return SourceScores(scores=scores, parts=parts, errors=errors)


def _dict_entry(
    value: Mapping[str, Any], i: int, parts: dict[str, list[float | None]], n: int
) -> tuple[float | None, str | None]:
    """(overall score, error) of one dict entry; its other parts are written into ``parts`` at row ``i``."""
    if OVERALL not in value:
        return None, f"returned parts {sorted(value)} without an {OVERALL!r} part"
    score, error = _as_score(value[OVERALL])
    for key, part_value in value.items():
        if key == OVERALL:
            continue
        if not isinstance(key, str) or not key or "/" in key:
            return None, f"part name {key!r} must be a non-empty string without '/'"
        part, part_error = _as_score(part_value)
        if part_error is not None:
            return None, f"part {key!r} {part_error}"
        parts.setdefault(key, [None] * n)[i] = part
    return score, error


async def wait_all_or_first_error(tasks: list[asyncio.Future]) -> None:
    """Wait for all tasks; on the first failure cancel the rest (awaiting them) and re-raise it."""
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in done if not t.cancelled() and t.exception() is not None]
    if failed:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed[0].exception()
