"""Where a step's experiences come from: the one thing a launch mode changes in the training loop.

The loop (:class:`~mmrlhf.trainer.loop.Trainer`) asks its source for this rank's samples of a step
(:meth:`RolloutSource.collect`), updates the policy and the critic on them, then lets the source make the new weights
the ones it samples with (:meth:`RolloutSource.publish`). :class:`LocalRollouts` is the in-process engine of one
process and of every torchrun rank; the Ray mode's rollout actors are :class:`~mmrlhf.launch.ray.source.RayRollouts`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import torch

from mmrlhf.algorithms.dynamic_sampling import (
    Chosen,
    GroupSelection,
    SampledGroups,
    choose_first,
    fill_batch,
    filter_groups,
    first_in_step_order,
)
from mmrlhf.algorithms.groups import isolate_invalid
from mmrlhf.data.stream import PromptStream, record_columns
from mmrlhf.experience.batching import TrainItem, split_experience
from mmrlhf.experience.rollout import (
    Rollout,
    ScoredRollout,
    ScoringDistribution,
    describe_skips,
    merge_round_metrics,
)
from mmrlhf.experience.step_shaping import combined_rewards
from mmrlhf.parallel.world import World
from mmrlhf.rollout.base import WAKE_KV_CACHE, WAKE_WEIGHTS
from mmrlhf.rollout.weight_sync import sync_weights

logger = logging.getLogger(__name__)


class RolloutSourceError(RuntimeError):
    """The source can deliver no more experiences (e.g. a rollout actor died and may not be restarted); the run
    saves the last finished step and stops."""


SKIPS_SHOWN = 20  # skip lines per share sent with the step's emptiness check (the counts stay exact in metrics)


class EmptyStepError(RuntimeError):
    """No share of a step (no rank, no rollout actor) generated a sample: every prompt was skipped."""

    def __init__(self, step: int, skipped: Sequence[str], shares: int) -> None:
        self.step, self.skipped, self.shares = step, list(skipped), shares
        where = "on any of the %d ranks / rollout actors" % shares if shares > 1 else "in this process"
        super().__init__(
            f"step {step + 1}: no sample to train {where}: every prompt of the step was skipped or gave no sample "
            f"({describe_skips(self.skipped)}). Check the data and the limits that skip prompts (data.on_bad_input, "
            "data.prompt_overflow with data.prompt_max_len, rollout.prompt_too_long with rollout.max_model_len)")

    def __reduce__(self) -> tuple[Any, ...]:  # it crosses processes (a Ray rollout actor's error reaches the driver)
        return type(self), (self.step, self.skipped, self.shares)


@dataclass
class StepBatch:
    """This rank's share of one step, ready to train."""

    items: list[TrainItem]  # empty: nothing kept this step (dynamic sampling found no group with variance)
    metrics: dict[str, float]  # rollout and experience metrics of this rank's share
    # what the old log-probs were computed under, and so the update's new ones (the rollout's, as generated)
    distribution: ScoringDistribution = field(default_factory=ScoringDistribution)
    # This rank's rollout, when it was made in this process: the loop builds the per-step report from it at report
    # time (mmrlhf.trainer.reporting.report_samples).
    rollout: ScoredRollout | None = None
    # What the per-step report shows, built where the rollout was made and sent as plain data, when the rollout itself
    # stays there (a Ray rollout actor, on report steps): list[ReportSample]. Wins over ``rollout``.
    report: list[Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # phase timings


class RolloutSource(Protocol):
    def start(self, step: int, policy: Any, critic: Any | None) -> None:
        """Before the first step (``step``: the checkpoint's, 0 on a fresh run): what must hold the current policy
        gets it."""

    def collect(self, step: int) -> StepBatch:
        """This rank's experiences of ``step`` (0-based). Every rank calls it."""

    def publish(self, policy: Any, critic: Any | None, *, updated: bool) -> dict[str, float]:
        """After the update (or its failure, ``updated=False``): the engines sample with the new weights. Every rank
        calls it (gathering sharded weights is collective)."""

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation with the current weights (rank 0 only)."""

    def save(self, folder: Path, step: int) -> dict[str, Any]:
        """At a checkpoint of ``step`` finished steps (every rank; rank 0's return is saved): the data position and
        sampling counters a resume restores (JSON), files it needs written into ``folder``. One format for every
        source: the position is ``{"stream": ..., "maker": ...}``, so a run resumes in another launch mode."""

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """Restore what :meth:`save` returned (every rank)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class LocalSettings:
    rollout_batch_size: int
    dynamic_sampling: bool = False
    dynamic_sampling_max_extra_rounds: int = 3
    dynamic_sampling_tol: float = 0.0
    sync_only_trainable: bool = True
    # The engine sleeps from the end of a generation until :meth:`LocalRollouts.publish` wakes it (where it can:
    # vLLM sleep mode). Off for a Ray rollout actor: its weights arrive by push, and nothing would wake it.
    engine_sleeps: bool = True
    # Which prompts of each step this producer generates: (index, count) takes ``records[index::count]``; None: this
    # rank's share of the world's (``rank::world_size``). A Ray rollout actor is one share of the step.
    share: tuple[int, int] | None = None
    # algorithm.reward_combination and its eps: the group filter ranks samples by the reward the shaping trains on
    reward_combination: str = "sum"
    reward_component_eps: float = 1e-6
    # rollout.tensor_parallel_size under torchrun: this many consecutive ranks share one engine and generate their
    # group's prompts together, each training its own (mmrlhf.parallel.engine_groups); 1: an engine per rank
    engine_group_size: int = 1


class LocalRollouts:
    """An engine in this process (vLLM or transformers), its experience maker and the prompt stream: the one
    producer of step batches, for one process, every torchrun rank and every Ray rollout actor (which holds one
    made by the same factory and only positions its stream and seeds its maker per step).

    Every rank reads the same stream (same seed) and generates its own share of whole prompts (``rank::world``), so
    GRPO groups never straddle ranks. With dynamic sampling every rank samples its share of each round and the ranks
    decide together which groups fill the batch, as one process would on the whole round; each keeps its own (see
    :meth:`sample_step`). With ``rollout.enable_sleep`` the engine hands its memory to the forwards and
    updates from the end of generation until :meth:`publish` wakes it in two parts: its weights before the sync
    (the trainer still holds its memory), its KV cache after, so the peak is trainer + engine weights."""

    def __init__(self, maker: Any, stream: PromptStream, world: World, settings: LocalSettings,
                 evaluator: Any | None = None) -> None:
        self.maker, self.stream, self.world, self.s, self.evaluator = maker, stream, world, settings, evaluator
        self.engine = maker.engine

    @property
    def evaluates_beside_main(self) -> bool:
        """A rank other than 0 that shares rank 0's engine evaluates beside it (the loop asks)."""
        return self.evaluator is not None and not self.world.is_main

    @property
    def sleeps(self) -> bool:
        """Whether the engine sleeps between generations (vLLM sleep mode, ``rollout.enable_sleep`` on CUDA)."""
        return self.s.engine_sleeps and bool(getattr(self.engine, "supports_sleep", False))

    def start(self, step: int, policy: Any, critic: Any | None) -> None:
        return None  # the engine was built from the policy's weights (or the checkpoint's)

    # ---- collect -------------------------------------------------------------------------------------------------
    def collect(self, step: int) -> StepBatch:
        seconds: dict[str, float] = {}
        with timed(seconds, "rollout"):
            rollout, metrics, trains = self.sample_step(step)
        if rollout is None:
            return StepBatch([], metrics, seconds=seconds)
        return self.prepare(rollout, metrics, seconds, describe=trains, step=step)

    def prepare(self, rollout: ScoredRollout, metrics: dict[str, float],
                seconds: dict[str, float] | None = None, *, describe: bool = True, step: int | None = None
                ) -> StepBatch:
        """A rollout of this rank turned into its step batch: the engine sleeps (it is woken by :meth:`publish`),
        the maker scores the samples with the trainer's models. ``describe=False``: an inert sample
        (:func:`inert`), whose experience metrics describe nothing (the other ranks' make the step's). ``step``: the
        steps finished before this one (the maker anneals ``agent.tool_bonus`` by it)."""
        seconds = {} if seconds is None else seconds
        if self.sleeps:
            with timed(seconds, "engine_sleep"):
                self.engine.sleep()
        try:
            with timed(seconds, "experience"):
                # the maker agrees with the other ranks on the number of scoring forwards (sharded ones pair)
                experiences = self.maker.experiences_from(rollout, world=self.world, step=step)
                items = [item for exp in experiences for item in split_experience(exp)]
        except BaseException:
            self._wake(None)
            raise
        if describe:
            metrics.update({k: v for k, v in experiences[0].info["batch"].items() if k not in metrics})
        return StepBatch(items, metrics, rollout.distribution, rollout=rollout if describe else None,
                         seconds=seconds)

    def sample_step(self, step: int) -> tuple[ScoredRollout | None, dict[str, float], bool]:
        """One round of ``rollout_batch_size`` prompts, or (dynamic sampling) rounds until that many groups with
        reward variance are kept. Metrics describe everything sampled; the rollout holds what trains.

        With several ranks the rounds are the step's: the informative groups are taken in the order of the whole
        round (prompts interleave ranks, ``rank::world``) over every rank's candidates, so the kept set, and the
        number of rounds, are one process's; every rank keeps its own groups of that set. A rank whose share kept
        none, or whose every prompt was skipped, trains one inert sample (:func:`inert`) while the others train
        theirs: its forwards and updates must pair with theirs (the flag: False for it). None: no rank kept a group.
        A step with no sample on any rank is :class:`EmptyStepError` (:meth:`_cover`)."""
        s, rounds = self.s, []
        if not s.dynamic_sampling:
            rollout, _ = self._sample(s.rollout_batch_size)
            metrics = dict(rollout.metrics)
            metrics.update(variance_metrics([rollout], s.dynamic_sampling_tol, **self._combination))
            covered, trains = self._cover(rollout, True, [rollout], step)
            return covered, metrics, trains

        shared = self.world.world_size > 1  # the step's shares choose together (torchrun ranks, Ray rollout actors)

        def sample_round() -> SampledGroups:
            rollout, asked = self._sample(s.rollout_batch_size)
            rounds.append(rollout)
            positions = share_positions(rollout.rows, asked) if shared else {}
            return SampledGroups(*group_rewards(rollout, **self._combination), payload=_Round(rollout, positions))

        fill = fill_batch(sample_round, s.rollout_batch_size, s.dynamic_sampling_max_extra_rounds,
                          tol=s.dynamic_sampling_tol, choose=self._choose if shared else choose_first)
        metrics = merge_round_metrics([r.metrics for r in rounds], [len(r) for r in rounds])
        metrics.update(variance_metrics(rounds, s.dynamic_sampling_tol, **self._combination))
        metrics.update(fill.metrics())
        if not fill.num_groups:  # (the step's count: every rank takes this branch together)
            rollout, trains = None, False
        elif not fill.parts:
            rollout, trains = (inert(rounds[-1]) if len(rounds[-1]) else rounds[-1]), False
        else:
            parts = [part.payload.rollout.select(part.indices.tolist()) for part in fill.parts]
            rollout, trains = ScoredRollout.concat(parts), True
        rollout, trains = self._cover(rollout, trains, rounds, step)
        return rollout, metrics, trains

    def _cover(self, rollout: ScoredRollout | None, trains: bool, rounds: Sequence[ScoredRollout], step: int
               ) -> tuple[ScoredRollout | None, bool]:
        """A share with nothing to train made inert, or the step's error (collective over the step's shares).

        Why: every prompt of a rank's share may be skipped (a missing image under ``data.on_bad_input=skip``, a
        prompt over ``prompt_max_len`` or the engine's context, trajectories that ended before their first turn).
        Its forwards and updates must still pair with the other ranks' (FSDP2 gathers in each), and its shaping with
        the others' step statistics, so it trains the first sample of a share that has one (its donor, the lowest
        such rank), made inert: it trains nothing and counts in no statistic. A step in which no share generated a
        sample raises :class:`EmptyStepError` on every share alike, naming the step, the records and the reasons.
        ``rounds``: what this share generated this step (its rows count as generated)."""
        w = self.world
        have = rollout is not None and len(rollout) > 0
        generated = sum(len(r) for r in rounds)
        skipped = [line for r in rounds for line in r.skipped]
        shares = [(generated, have, skipped)] if w.world_size == 1 else \
            w.gather_objects((generated, have, skipped[:SKIPS_SHOWN]))
        if not sum(g for g, _, _ in shares):
            raise EmptyStepError(step, [line for _, _, lines in shares for line in lines], w.world_size)
        needy = [r for r, (_, h, _) in enumerate(shares) if not h]
        if rollout is None or not needy:  # nothing kept anywhere (dynamic sampling), or nobody needs a donor
            return rollout, trains
        donor = next(r for r, (_, h, _) in enumerate(shares) if h)
        given = w.gather_objects(inert(rollout) if w.rank == donor else None)[donor]
        if have:
            return rollout, trains
        logger.warning("step %d: share %d of %d has no sample (%s); it trains an inert sample beside the other "
                       "shares", step + 1, w.rank, w.world_size, describe_skips(skipped))
        return given, False

    @property
    def _combination(self) -> dict[str, Any]:
        return {"combination": self.s.reward_combination, "eps": self.s.reward_component_eps}

    def _choose(self, sel: GroupSelection, batch: SampledGroups, room: int) -> Chosen:
        """The step's choice of a round's informative groups (collective): every rank's candidates, named by their
        prompt's position in the whole round, gathered; the first ``room`` of the round are kept."""
        w, positions = self.world, batch.payload.positions
        candidates = sel.kept_groups.tolist()
        shares = w.gather_objects((sel.num_groups, [positions[g] * w.world_size + w.rank for g in candidates]))
        taken = first_in_step_order([c for _, c in shares], room)
        mine = sel.kept_groups[torch.tensor(taken[w.rank], dtype=torch.long)]
        return Chosen(mine, sum(len(t) for t in taken), sum(n for n, _ in shares))

    def _sample(self, n_prompts: int) -> tuple[ScoredRollout, list[Any]]:
        """This rank's share of a round, and the record ids of the prompts it asked for, in order. With engine
        groups (:attr:`LocalSettings.engine_group_size` > 1) the rank generates its group's prompts beside the
        group's other ranks and keeps the part it trains (:func:`~mmrlhf.trainer.group_share.member_part`): the
        same ``rank::world`` prompts as with an engine of its own."""
        records = self.stream.next_batch(n_prompts)  # every rank draws the same global batch (same seed) ...
        if self.s.share is None and self.s.engine_group_size > 1:
            return self._sample_in_group(records)
        index, count = self.s.share or (self.world.rank, self.world.world_size)
        columns = record_columns(records[index::count])  # ... and generates its share
        return self.maker.generate_rollout(**columns), columns["record_ids"]

    def _sample_in_group(self, records: Sequence[Any]) -> tuple[ScoredRollout, list[Any]]:
        from mmrlhf.parallel.engine_groups import EngineGroups
        from mmrlhf.trainer.group_share import member_part, owned_ids

        w = self.world
        groups = EngineGroups(w.world_size, self.s.engine_group_size)
        group = groups.group_of(w.rank)
        indices = groups.group_indices(len(records), group)
        columns = record_columns([records[i] for i in indices])  # the group's prompts, the same on its every rank
        owners = [groups.trainer_of(i) for i in indices]
        rollout = self.maker.generate_rollout(**columns)
        asked = columns["record_ids"]
        part = member_part(rollout, share_positions(rollout.rows, asked), owners, w.rank,
                           lead=w.rank == groups.ranks_of(group)[0])
        return part, owned_ids(asked, owners, w.rank)

    # ---- publish -------------------------------------------------------------------------------------------------
    def publish(self, policy: Any, critic: Any | None, *, updated: bool) -> dict[str, float]:
        """Wake the engine's weights, sync the policy into it (a failed update: wake everything, no sync), wake its
        KV cache."""
        seconds: dict[str, float] = {}
        if not updated:
            self._wake(None)
            return {}
        if self.sleeps:
            with timed(seconds, "engine_wake"):
                self.engine.wake_up(tags=WAKE_WEIGHTS)
        # Sleep level 2 discards the engine's weights: the sync must then restore all of them, frozen ones too.
        only_trainable = self.s.sync_only_trainable and not (
            self.sleeps and getattr(self.engine, "sleep_discards_weights", False))
        try:
            with timed(seconds, "sync"):
                metrics = sync_weights(policy.actor.model, self.engine, only_trainable=only_trainable)
        finally:
            if self.sleeps:
                with timed(seconds, "engine_wake_kv"):
                    self.engine.wake_up(tags=WAKE_KV_CACHE)
        metrics.update({f"time/{k}": v for k, v in seconds.items()})
        return metrics

    def _wake(self, tags: Any) -> None:
        if self.sleeps:
            self.engine.wake_up(tags=tags)

    # ---- the rest ------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        if self.evaluator is None:
            return {}
        return self.evaluator.run()

    def save(self, folder: Path, step: int) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "maker": self.maker.state_dict()}

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.maker.load_state_dict(state["maker"])

    def close(self) -> None:
        return None


# ---- helpers (pure) --------------------------------------------------------------------------------------------
def group_rewards(rollout: ScoredRollout, *, combination: str = "sum",
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] rewards, [N] group ids) for group filtering; samples the reward engine masked out get a group of their
    own (:func:`~mmrlhf.algorithms.groups.isolate_invalid`: a singleton has no spread and is dropped). The rewards
    are the ones the step trains on (:func:`~mmrlhf.experience.step_shaping.combined_rewards`): with
    ``per_component`` a group is informative when the weighted sum of its terms' z-scores varies."""
    r = rollout.rewards
    rewards = combined_rewards(r, rollout.group_ids, combination=combination, eps=eps)
    return rewards, isolate_invalid(rollout.group_ids, r.valid)


def variance_metrics(rounds: Sequence[ScoredRollout], tol: float, *, combination: str = "sum",
                     eps: float = 1e-6) -> dict[str, float]:
    """Share of sampled groups whose rewards vary: the early warning of GRPO collapse (no variance, no signal)."""
    kept = total = 0
    for rollout in rounds:
        rewards, groups = group_rewards(rollout, combination=combination, eps=eps)
        valid_groups = groups[rollout.rewards.valid]
        if not valid_groups.numel():
            continue
        sel = filter_groups(rewards[rollout.rewards.valid], valid_groups, tol=tol)
        kept += int(sel.kept_groups.numel())
        total += sel.num_groups
    return {"groups/with_variance_frac": kept / total if total else 0.0, "groups/sampled": float(total)}


def share_positions(rows: Rollout, record_ids: Sequence[Any]) -> dict[int, int]:
    """Group id -> position of its prompt among the ``record_ids`` asked for: groups come in prompt order, each
    record's id travels with its samples, and a skipped prompt (data error, too long) has no group."""
    free: dict[Any, list[int]] = {}
    for pos, rid in enumerate(record_ids):
        free.setdefault(rid, []).append(pos)
    out: dict[int, int] = {}
    for group, rid in zip(rows.group, rows.record_ids):
        if group not in out:
            out[group] = free[rid].pop(0)
    return out


def inert(rollout: ScoredRollout) -> ScoredRollout:
    """The first sample of ``rollout`` masked out as the reward engine masks a failed one: it trains nothing and
    counts in no statistic of the step (rewards, KL, advantages, entropies, loss denominators), yet runs every
    forward and update."""
    one = rollout.select([0])
    one.rewards = dataclasses.replace(one.rewards, rewards=torch.zeros(1), valid=torch.zeros(1, dtype=torch.bool))
    return one


@dataclass(frozen=True)
class _Round:
    rollout: ScoredRollout
    positions: dict[int, int]  # group id -> its prompt's position in this rank's share of the round


@contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
