"""The shared skeleton of the policy and the critic update: epochs of shuffled mini-batches, each accumulated over
micro-batches, then one clipped optimiser step guarded against non-finite losses and gradients.

Why the guard lives here: a single NaN or inf in one micro-batch's loss (an overflow, a corrupt sample) would, once
stepped, turn every parameter into NaN and silently end the run. The guard skips that optimiser step (gradients
dropped, a warning logged, counted) and raises :class:`NonFiniteError` after ``max_consecutive`` skips in a row,
when the run is clearly broken rather than unlucky.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Hashable, Iterator, Sequence

import torch
from torch import nn

from mmrlhf.models.compute_copy import ComputeCopy
from mmrlhf.parallel.aligned import run_aligned
from mmrlhf.parallel.micro_batches import Budget, Layout, SampleCost, plan_micro_batches, split_metrics
from mmrlhf.parallel.world import World, single

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many optimiser steps in a row had a non-finite loss or gradient: training stops."""


def epoch_order(n: int, generator: torch.Generator | None, groups: Sequence[Hashable] | None = None) -> list[int]:
    """One epoch's item order: in order without ``generator``; else a random permutation that keeps the items of
    one group (equal ``groups[i]``, e.g. the same prompt) next to each other: groups in random order, members
    shuffled within. Adjacent siblings land in the same micro-batch, where the shared-prompt layout encodes their
    prompt once; mini-batches then hold whole groups, as GRPO's per-group statistics suggest anyway."""
    if generator is None:
        return list(range(n))
    if groups is None:
        return torch.randperm(n, generator=generator).tolist()
    if len(groups) != n:
        raise ValueError(f"{len(groups)} group keys for {n} items")
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    ordered = list(members.values())
    order: list[int] = []
    for g in torch.randperm(len(ordered), generator=generator).tolist():
        inner = ordered[g]
        order.extend(inner[j] for j in torch.randperm(len(inner), generator=generator).tolist())
    return order


def minibatches(n: int, batch_size: int, micro_size: int, epochs: int, generator: torch.Generator | None,
                groups: Sequence[Hashable] | None = None) -> Iterator[tuple[int, list[list[int]]]]:
    """``(epoch, micro-batches of one mini-batch)`` over ``n`` items: a fresh :func:`epoch_order` per epoch; the
    last mini-batch of an epoch may be smaller, never empty."""
    for epoch in range(epochs):
        order = epoch_order(n, generator, groups)
        for s in range(0, n, batch_size):
            mini = order[s: s + batch_size]
            yield epoch, [mini[m: m + micro_size] for m in range(0, len(mini), micro_size)]


@dataclass
class MetricSums:
    """Weighted sums of scalar metrics over micro-batches (weights: the micro-batch's token or sample count)."""

    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: dict[str, float | torch.Tensor], weight: float) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * weight
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def all_reduced(self, world: Any) -> "MetricSums":
        """Sums and weights added over ranks (every rank reports the same metric names)."""
        keys = sorted(self.sums)
        names = world.broadcast_object(keys)
        if names != keys:
            raise RuntimeError(f"ranks report different update metrics: {keys} vs rank 0's {names}")
        totals = world.all_sum([self.sums[k] for k in keys] + [self.weights[k] for k in keys])
        return MetricSums(dict(zip(keys, totals[: len(keys)])), dict(zip(keys, totals[len(keys):])))

    def means(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}{k}": self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


class GuardedStepper:
    """Clip, check and step one optimiser; counts skipped steps (``state_dict`` for resume)."""

    def __init__(self, params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, max_grad_norm: float,
                 max_consecutive: int, name: str, world: World | None = None,
                 compute_copy: ComputeCopy | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        # trainer.compute_copy: the model's matrix weights cast once per optimiser step (mmrlhf.models.compute_copy)
        self.compute_copy = compute_copy
        self.world = world or single()  # the training ranks (the update loop normalises over all of them)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.max_grad_norm, self.max_consecutive, self.name = max_grad_norm, max_consecutive, name
        self.skipped_total = 0
        self.skipped_in_a_row = 0
        self.steps = 0

    def step(self, loss_finite: bool) -> tuple[float, bool]:
        """(gradient norm before clipping, whether the step was taken). Gradients are zeroed either way."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: the global norm
        ok = loss_finite and math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.steps += 1
            self.skipped_in_a_row = 0
        else:
            self.skipped_total += 1
            self.skipped_in_a_row += 1
            logger.warning("%s update skipped: non-finite %s (%d in a row, %d in total)", self.name,
                           "loss" if not loss_finite else f"gradient norm ({grad_norm})", self.skipped_in_a_row,
                           self.skipped_total)
            if self.skipped_in_a_row >= self.max_consecutive:
                raise NonFiniteError(
                    f"{self.name}: {self.skipped_in_a_row} optimiser steps in a row had a non-finite loss or gradient;"
                    " stopping (lower the learning rate, check the rewards and the data; the last checkpoint is "
                    "intact)")
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, ok

    def computing(self) -> ContextManager[Any]:
        """The region of one optimiser step's forwards and backwards: the compute copy's, when there is one."""
        return self.compute_copy.active() if self.compute_copy is not None else contextlib.nullcontext()

    def release(self) -> None:
        """The end of an update: the compute copy's memory goes back (it is cast again at the next update)."""
        if self.compute_copy is not None:
            self.compute_copy.release()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "skipped_total": self.skipped_total, "skipped_in_a_row": self.skipped_in_a_row, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_total = int(state["skipped_total"])
        self.skipped_in_a_row = int(state["skipped_in_a_row"])
        self.steps = int(state["steps"])


def _aligned_over_ranks(plan: list[tuple[int, list[list[int]]]], world: Any) -> list[tuple[int, list[list[int]]]]:
    """``plan`` padded so that every rank runs as many mini-batches, and as many micro-batches in each, as the rank
    with the most. Ranks hold different numbers of samples when prompts were skipped on one of them; FSDP's
    collectives in each forward and backward (and the denominator's all-reduce) must pair across ranks, or every
    rank waits forever. A padding micro-batch (an empty list, run by :func:`~mmrlhf.parallel.aligned.run_aligned`)
    runs a forward and backward with zero weight."""
    minis = int(world.all_max([float(len(plan))])[0])
    plan = plan + [(plan[-1][0] if plan else 0, [])] * (minis - len(plan))
    sizes = world.all_max([float(len(micros)) for _, micros in plan])
    return [(epoch, micros + [[] for _ in range(int(size) - len(micros))]) for (epoch, micros), size in zip(plan, sizes)]


def run_minibatches(counts: Sequence[float], *, batch_size: int, micro_size: int, epochs: int,
                    generator: torch.Generator | None, stepper: GuardedStepper,
                    micro_loss: Callable[[list[int], float], tuple[torch.Tensor, dict]],
                    prefix: str, groups: Sequence[Hashable] | None = None,
                    costs: Sequence[SampleCost] | None = None, layout: Layout | None = None,
                    max_tokens: Budget = None) -> dict[str, float]:
    """The update loop over ``len(counts)`` items; ``counts[i]`` is item ``i``'s aggregation count (tokens or 1 per
    response). ``micro_loss(micro, denominator)`` returns the micro-batch's share of its mini-batch loss (divided by
    ``denominator``, the mini-batch's total count) and its metrics. Returns ``prefix``-ed metrics: count-weighted
    means of the micro-batch metrics, the mean gradient norm of the steps taken, steps taken and skipped (non-finite),
    mini-batches with nothing to train (count 0: no forward, no optimiser or schedule step), the LR.
    ``groups``: per-item group keys that shuffling keeps together (see :func:`epoch_order`).

    ``costs`` (per item, laid out as ``layout``): each mini-batch is split into micro-batches by
    :func:`~mmrlhf.parallel.micro_batches.plan_micro_batches` under ``micro_size`` and the token budget
    ``max_tokens`` (None: ``micro_size`` samples each, as without costs), and the split is logged
    (``micro_batches``, ``micro_batch_tokens_max`` / ``_mean``, ``micro_batch_rank_imbalance``,
    ``oversized_micro_batches``). Which items share a micro-batch never changes the step: every micro-batch loss is
    divided by its MINI-batch's count.

    With several training ranks (``stepper.world``) every rank holds its own share of the items and ``batch_size`` is the GLOBAL
    mini-batch: each rank takes ``batch_size / world_size`` of its items per optimiser step, the denominator is the
    count summed over ranks, and the loss is scaled by ``world_size`` because FSDP averages the gradients over ranks,
    so the step equals the one a single process would take on the whole mini-batch. Ranks holding different numbers
    of items (a prompt skipped on one) run padding micro-batches of zero weight so their collectives pair
    (:func:`_aligned_over_ranks`)."""
    world = stepper.world
    n_ranks = world.world_size
    if batch_size % n_ranks:
        raise ValueError(f"trainer.train_batch_size={batch_size} must be a multiple of the number of ranks ({n_ranks})")
    if world.all_max([0.0 if counts else 1.0])[0]:
        raise RuntimeError("a rank holds no sample to train this step (all its prompts were skipped): every rank "
                           "stops here rather than wait on it; check skipped_prompts and the data")
    sums, norms, skipped, empty = MetricSums(), [], 0, 0
    plan = list(minibatches(len(counts), batch_size // n_ranks, micro_size, epochs, generator, groups))
    split = None
    if costs is None:
        plan = _aligned_over_ranks(plan, world)  # as it is in a world of one rank
    else:
        if len(costs) != len(counts):
            raise ValueError(f"{len(costs)} costs for {len(counts)} items")
        split = plan_micro_batches(costs, [[i for m in micros for i in m] for _, micros in plan],
                                   layout or Layout(), samples=micro_size, tokens=max_tokens, world=world)
        epochs_of = [epoch for epoch, _ in plan]
        epochs_of += [epochs_of[-1] if epochs_of else 0] * (len(split.micro_batches) - len(epochs_of))
        plan = list(zip(epochs_of, split.micro_batches))
    for _, micros in plan:
        denominator = world.all_sum([sum(counts[i] for m in micros for i in m)])[0]
        if denominator == 0:
            # Nothing of this mini-batch trains (every sample masked by the reward engine or the correction): a
            # step would still move the weights through Adam's momentum and advance the schedule. No forward, no
            # step; the denominator is global, so every rank skips together.
            empty += 1
            continue
        finite = True

        def forward(micro: list[int], padding: bool) -> None:
            nonlocal finite
            loss, metrics = micro_loss(micro, denominator)
            # A non-finite loss skips the step (the flag, agreed by every rank); the remaining backwards still run,
            # as sharded ranks must run the same ones (they reduce-scatter). FSDP averages the gradients over
            # ranks: scaled by their number, the step is the whole batch's (x 1.0 is exact in a world of one rank).
            # A padding micro-batch (this rank holds fewer) pairs the other ranks' collectives with zero weight.
            finite = finite and bool(torch.isfinite(loss.detach()).all())
            (loss * (0.0 if padding else n_ranks)).backward()
            if not padding:
                sums.add(metrics, sum(counts[i] for i in micro))

        with stepper.computing():
            run_aligned(micros, forward, pad=[0])
        grad_norm, ok = stepper.step(world.all_true(finite))
        if ok:
            norms.append(grad_norm)
        else:
            skipped += 1
    stepper.release()
    sums = sums.all_reduced(world)
    out = sums.means(prefix)
    if split is not None:
        out.update(split_metrics(split, world, prefix))
    out.update({f"{prefix}grad_norm": sum(norms) / len(norms) if norms else float("nan"),
                f"{prefix}optimizer_steps": float(len(norms)), f"{prefix}skipped_steps": float(skipped),
                f"{prefix}empty_minibatches": float(empty),
                f"{prefix}skipped_steps_total": float(stepper.skipped_total), f"{prefix}lr": stepper.lr})
    return out
