"""``RewardComputationEngine``: per-label recipes over named reward sources, with real filtering.

For a batch, each sample's label selects its recipe (a list of ``(source, weight)``). Each source is run ONCE, on
exactly the samples whose recipe gives it a non-zero weight, in batch order (a reward model never sees a sample
it was not asked about: no wasted compute, no leaking of other tasks' data to a remote server). Sources run
concurrently; their answers are scattered back by row and combined as ``sum(weight * score)`` over the sources
that apply to the sample (a ``None`` score means "does not apply" and drops that term).

Failure policy (``on_failure``): a source failing on a sample (raised, NaN, wrong type) or returning a wrong number
of scores either stops the step with an error naming the source and sample (``error``), or masks the affected
samples out of the loss and counts them (``mask``). The finite-score rule is checked here once more for EVERY
source (whatever it is), so NaN keeps meaning "not run / does not apply" and never leaks from a bad answer into a
reward. A sample to which no source applies is masked and counted too: a made-up 0 would bias its group's
advantage. A remote server that stays down always raises: silently masking a whole batch would train on nothing
while looking healthy.

A weight of 0 means "not run"; a recipe whose weights are all 0 is refused (it would mask every sample of its label
while looking configured); an empty recipe ``[]`` masks its label on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import threading
from concurrent.futures import Executor
from typing import Literal, Mapping, Sequence

import torch

from mmrlhf.rewards.plugins import WrongCountError, wait_all_or_first_error
from mmrlhf.rewards.runners import DaemonThreadPool, run_loop_serving_main_thread
from mmrlhf.rewards.sources import RewardSource, build_source
from mmrlhf.rewards.types import RewardBatch, RewardError, RewardResult, SourceScores

logger = logging.getLogger(__name__)

Recipe = Sequence[tuple[str, float]]
FailurePolicy = Literal["error", "mask"]


class RewardComputationEngine:
    """Computes combined rewards for a :class:`RewardBatch` from named sources and per-label recipes."""

    def __init__(
        self,
        sources: Mapping[str, RewardSource],
        recipe: Mapping[str, Recipe],
        *,
        default_recipe: Recipe | None = None,
        on_failure: FailurePolicy = "error",
        executor: Executor | None = None,
    ) -> None:
        """``executor``: the pool the engine's synchronous function sources run in (kept alive with the engine)."""
        if on_failure not in ("error", "mask"):
            raise ValueError(f"on_failure must be 'error' or 'mask', got {on_failure!r}")
        self.sources = dict(sources)
        self.recipe = {label: [(s, float(w)) for s, w in entries] for label, entries in recipe.items()}
        self.default_recipe = None if default_recipe is None else [(s, float(w)) for s, w in default_recipe]
        self.on_failure = on_failure
        self.executor = executor
        for label, entries in [*self.recipe.items(), ("<default_recipe>", self.default_recipe or [])]:
            for source, weight in entries:
                if source not in self.sources:
                    raise RewardError(
                        f"recipe {label!r} uses unknown reward source {source!r}; known: {sorted(self.sources)}"
                    )
                if not math.isfinite(weight):
                    raise RewardError(f"recipe {label!r}: weight of {source!r} must be finite, got {weight}")
            if entries and all(weight == 0.0 for _, weight in entries):
                raise RewardError(
                    f"recipe {label!r} gives every source a weight of 0 (= not run): every sample of that label "
                    "would be masked; give a source a non-zero weight, or use an empty recipe to mask it on purpose"
                )

    @classmethod
    def from_config(cls, config) -> "RewardComputationEngine":
        """Build from a :class:`mmrlhf.config.reward.RewardConfig` (builds every source in ``label_map``)."""
        pool = DaemonThreadPool(config.function_workers, thread_name_prefix="reward-fn")
        sources = {name: build_source(name, cfg, executor=pool) for name, cfg in config.label_map.items()}
        return cls(
            sources, config.recipe, default_recipe=config.default_recipe, on_failure=config.on_failure, executor=pool
        )

    def recipe_for(self, label: str, where: str = "") -> list[tuple[str, float]]:
        """The recipe of ``label`` (or the default one); an unknown label without a default is an error."""
        if label in self.recipe:
            return self.recipe[label]
        if self.default_recipe is not None:
            return self.default_recipe
        raise RewardError(
            f"no reward recipe for label {label!r}{where} and no default_recipe; labels with a recipe: "
            f"{sorted(self.recipe)}"
        )

    def compute(self, batch: RewardBatch) -> RewardResult:
        """Synchronous entry point (runs its own event loop; use :meth:`acompute` from inside one).

        From the main thread, the loop runs in a helper thread while the main thread serves the functions that
        need it (signal-based timeouts), so those too run alongside remote requests (``mmrlhf.rewards.runners``).
        Errors are raised as they are, outside any ``except`` block (no chained context).
        """
        if _loop_running():
            raise RuntimeError(
                "RewardComputationEngine.compute() called inside a running event loop; await acompute()"
            )
        if threading.current_thread() is threading.main_thread():
            return run_loop_serving_main_thread(lambda: self.acompute(batch))
        return asyncio.run(self.acompute(batch))

    async def acompute(self, batch: RewardBatch) -> RewardResult:
        recipes = [self.recipe_for(label, f" ({batch.describe(i)})") for i, label in enumerate(batch.labels)]
        rows: dict[str, list[int]] = {}
        for i, recipe in enumerate(recipes):
            for source, weight in recipe:
                if weight != 0.0:
                    rows.setdefault(source, []).append(i)
        names = [name for name in self.sources if name in rows]
        tasks = [asyncio.ensure_future(self._run(name, batch.select(rows[name]))) for name in names]
        await wait_all_or_first_error(tasks)
        outputs = {name: task.result() for name, task in zip(names, tasks)}
        return self._combine(batch, recipes, rows, outputs)

    async def _run(self, name: str, sub: RewardBatch) -> SourceScores:
        source = self.sources[name]
        timeout = getattr(source, "timeout_s", None)
        try:
            out = await asyncio.wait_for(source.score(sub), timeout)
        except asyncio.TimeoutError:
            replace = getattr(self.executor, "replace_stuck", None)
            if replace is not None:  # the function's thread cannot be stopped: give the pool a fresh one instead
                replace(0.5 * timeout)
            message = (f"reward source {name!r} timed out after {timeout:g} s on {len(sub)} sample(s) "
                       f"({sub.describe(0)} ..); raise reward.label_map.{name}.timeout_s if it is just slow")
            if self.on_failure == "error":
                raise RewardError(message) from None
            logger.warning("%s: masked", message)
            return SourceScores(scores=[None] * len(sub), errors=[message] * len(sub))
        except WrongCountError as exc:
            if self.on_failure == "error":
                raise RewardError(f"reward source {name!r}: {exc}") from exc
            return SourceScores(scores=[None] * len(sub), errors=[f"{exc}"] * len(sub))
        if len(out.scores) != len(sub):  # a source class breaking its contract is a bug, never maskable
            raise RewardError(f"reward source {name!r} returned {len(out.scores)} scores for {len(sub)} samples")
        return _finite_only(name, out, sub)

    def _combine(
        self,
        batch: RewardBatch,
        recipes: list[list[tuple[str, float]]],
        rows: dict[str, list[int]],
        outputs: dict[str, SourceScores],
    ) -> RewardResult:
        n = len(batch)
        source_t = {name: torch.full((n,), float("nan")) for name in self.sources}
        parts_t: dict[str, torch.Tensor] = {}
        failed = [False] * n
        metrics: dict[str, float] = {}
        notes: dict[str, list[str | None]] = {}
        for name, out in outputs.items():
            self._scatter(name, out, rows[name], source_t[name], parts_t, failed, metrics)
            for note, texts in out.notes.items():
                column = notes.setdefault(f"{name}/{note}", [None] * n)
                for i, text in zip(rows[name], texts):
                    column[i] = text
        for key, column in parts_t.items():
            _mean_into(metrics, f"reward/{key}/mean", column)
        rewards, valid, no_source = _weighted_sum(recipes, source_t, failed)
        metrics["reward/masked"] = float((~valid).sum().item())
        metrics["reward/failed_samples"] = float(sum(failed))
        metrics["reward/no_applicable_source"] = float(no_source)
        _mean_into(metrics, "reward/mean", rewards[valid])
        for label in sorted(set(batch.labels)):
            mask = torch.tensor([lab == label for lab in batch.labels]) & valid
            _mean_into(metrics, f"reward/label/{label}/mean", rewards[mask])
        return RewardResult(rewards=rewards, valid=valid, sources=source_t, parts=parts_t, metrics=metrics,
                            notes=notes, weights=_recipe_weights(recipes, list(self.sources)))

    def _scatter(
        self,
        name: str,
        out: SourceScores,
        idx: list[int],
        column: torch.Tensor,
        parts_t: dict[str, torch.Tensor],
        failed: list[bool],
        metrics: dict[str, float],
    ) -> None:
        """Write one source's answer for rows ``idx`` into the [B] tensors; apply the failure policy."""
        errors = [(i, err) for i, err in zip(idx, out.errors) if err is not None]
        if errors and self.on_failure == "error":
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise RewardError(f"reward source {name!r} failed: {errors[0][1]}{more}")
        if errors:
            logger.warning("reward source %r: %d sample(s) masked; first: %s", name, len(errors), errors[0][1])
        for i, _ in errors:
            failed[i] = True
        for i, score in zip(idx, out.scores):
            if score is not None:
                column[i] = score
        for part, values in out.parts.items():
            part_column = parts_t.setdefault(f"{name}/{part}", torch.full_like(column, float("nan")))
            for i, value in zip(idx, values):
                if value is not None:
                    part_column[i] = value
        metrics[f"reward/{name}/count"] = float(len(idx))
        metrics[f"reward/{name}/failures"] = float(len(errors))
        not_applicable = sum(1 for s, e in zip(out.scores, out.errors) if s is None and e is None)
        metrics[f"reward/{name}/not_applicable"] = float(not_applicable)
        _mean_into(metrics, f"reward/{name}/mean", column[idx])


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _finite_only(name: str, out: SourceScores, sub: RewardBatch) -> SourceScores:
    """``out`` with every score (and part) that is not a finite real number turned into that sample's error.

    Function, model and remote sources check this themselves with precise messages; this is the engine's own
    guarantee for any source, because a NaN scattered into the [B] tensors would read as "does not apply".
    """
    problems: dict[int, str] = {}
    for i in range(len(out.scores)):
        for what, value in [("score", out.scores[i]), *((f"part {p!r}", v[i]) for p, v in out.parts.items())]:
            real = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if value is not None and not (real and math.isfinite(value)):
                problems[i] = f"reward source {name!r} on {sub.describe(i)}: {what} {value!r} is not a finite number"
                break
    if not problems:
        return out
    keep = lambda i, value: None if i in problems else value  # noqa: E731 - a failed sample keeps nothing
    return SourceScores(
        scores=[keep(i, v) for i, v in enumerate(out.scores)],
        parts={p: [keep(i, v) for i, v in enumerate(values)] for p, values in out.parts.items()},
        errors=[err or problems.get(i) for i, err in enumerate(out.errors)],
        notes=out.notes,
    )


def _weighted_sum(
    recipes: list[list[tuple[str, float]]], source_t: dict[str, torch.Tensor], failed: list[bool]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """([B] rewards, [B] valid, count of samples no source applied to): sum of weight * score per sample."""
    n = len(recipes)
    rewards = torch.zeros(n)
    valid = torch.ones(n, dtype=torch.bool)
    no_source = 0
    for i, recipe in enumerate(recipes):
        terms = [(w, source_t[s][i].item()) for s, w in recipe if w != 0.0]
        applied = [(w, v) for w, v in terms if not math.isnan(v)]
        if failed[i]:
            valid[i] = False
        elif not applied:
            valid[i] = False
            no_source += 1
        else:
            rewards[i] = sum(w * v for w, v in applied)
    return rewards, valid, no_source


def _recipe_weights(recipes: list[list[tuple[str, float]]], names: list[str]) -> dict[str, torch.Tensor]:
    """source name -> [B] its weight in each sample's recipe (a source listed twice: the sum, as the reward sums)."""
    out = {name: torch.zeros(len(recipes)) for name in names}
    for i, recipe in enumerate(recipes):
        for source, weight in recipe:
            out[source][i] += weight
    return out


def _mean_into(metrics: dict[str, float], key: str, values: torch.Tensor) -> None:
    """Record the mean of the non-NaN entries (nothing when there are none: an absent key, not a fake 0)."""
    values = values[~torch.isnan(values)]
    if values.numel():
        metrics[key] = float(values.mean().item())
