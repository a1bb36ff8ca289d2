"""Dynamic sampling (DAPO): keep only groups whose rewards vary, re-sample until the batch is full.

Why: a group whose samples all scored the same (all correct or all wrong) has zero group-relative advantage, so
it contributes no gradient but still dilutes the batch (and the token-mean denominator). Masking such groups is
not enough: the batch then shrinks by a varying amount every step. DAPO instead keeps sampling prompts until it
has the target number of informative groups.

Two pieces, both free of I/O: :func:`filter_groups` (pure: which groups of one batch to keep) and
:func:`fill_batch` (a small driver that calls a user-supplied ``sample_fn`` for more rounds and accumulates the
kept groups). The trainer's ``sample_fn`` does the generation and scoring; this module only decides.

With several training ranks each rank samples its share of every round, and the decision must be the step's: which
informative groups fill the batch is decided in the step's order over every rank's candidates
(:func:`first_in_step_order`), passed to :func:`fill_batch` as its ``choose`` (the trainer gathers the candidates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from mmrlhf.algorithms.groups import dense_group_index


@dataclass(frozen=True)
class GroupSelection:
    """Which samples / groups of one batch survive the zero-variance filter."""

    keep: Tensor  # [N] bool, per sample
    kept_groups: Tensor  # [K] the kept group ids, in order of first appearance in the batch
    num_groups: int  # groups in the batch


def filter_groups(rewards: Tensor, group_ids: Tensor, *, tol: float = 0.0) -> GroupSelection:
    """Keep the groups whose sequence rewards ``[N]`` span more than ``tol`` (max - min > tol).

    A group of size 1 has zero spread and is dropped: it has no peer to be compared with. Vectorised over
    groups (scatter amax/amin), any integer ids, uneven sizes.
    """
    rewards, group_ids = torch.as_tensor(rewards), torch.as_tensor(group_ids)
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    group_ids = group_ids.to(rewards.device)
    idx, g = dense_group_index(group_ids)  # [N]
    r = rewards.to(torch.float64)
    hi = torch.full((g,), -float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amax")  # [G]
    lo = torch.full((g,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amin")  # [G]
    pos = torch.arange(r.numel(), device=r.device)
    first = torch.full((g,), r.numel(), dtype=torch.long, device=r.device).scatter_reduce(0, idx, pos, "amin")  # [G]
    keep_group = (hi - lo) > tol  # [G]
    order = torch.argsort(first)  # groups in order of first appearance
    kept_dense = order[keep_group[order]]  # [K]
    kept_ids = group_ids[first[kept_dense]]  # [K]
    return GroupSelection(keep=keep_group[idx], kept_groups=kept_ids, num_groups=g)


@dataclass(frozen=True)
class SampledGroups:
    """What ``sample_fn`` returns: sequence rewards and group ids ``[N]`` plus any payload (the samples)."""

    rewards: Tensor
    group_ids: Tensor
    payload: Any = None


@dataclass(frozen=True)
class KeptPart:
    """The kept samples of one sampling round: ``payload`` as returned, and the indices into it to keep."""

    payload: Any
    indices: Tensor  # [n] long, sample positions within this round's batch, ascending
    group_ids: Tensor  # [k] kept group ids (this round's ids: rounds may reuse ids)


@dataclass
class FillResult:
    """What :func:`fill_batch` gathered: the kept parts of each round and how the filling went."""

    parts: list[KeptPart] = field(default_factory=list)
    num_groups: int = 0  # kept groups in total, over the step (<= target_groups)
    target_groups: int = 0
    rounds: int = 0  # calls of sample_fn, the first included
    sampled_groups: int = 0  # over the step

    @property
    def extra_rounds(self) -> int:
        return max(self.rounds - 1, 0)

    @property
    def fill_rate(self) -> float:
        return self.num_groups / self.target_groups if self.target_groups else 1.0

    @property
    def full(self) -> bool:
        return self.num_groups >= self.target_groups

    def metrics(self) -> dict[str, float]:
        """``dynamic_sampling/*`` metrics: rounds, extra rounds, fill rate, fraction of sampled groups kept."""
        kept_frac = self.num_groups / self.sampled_groups if self.sampled_groups else 0.0
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/extra_rounds": float(self.extra_rounds),
            "dynamic_sampling/fill_rate": self.fill_rate,
            "dynamic_sampling/kept_group_frac": kept_frac,
            "dynamic_sampling/sampled_groups": float(self.sampled_groups),
        }


@dataclass(frozen=True)
class Chosen:
    """What one round adds to the batch: the groups of this share to keep, and the round's counts over the step."""

    group_ids: Tensor  # [k] this share's kept group ids, in order of first appearance
    kept: int  # groups kept this round, over the whole step (this share's alone in one process)
    sampled: int  # groups sampled this round, over the whole step


def choose_first(sel: GroupSelection, batch: SampledGroups, room: int) -> Chosen:
    """One process: the first ``room`` informative groups of the round (the batch has a fixed size; the surplus is
    the cheapest thing to waste)."""
    chosen = sel.kept_groups[:room]  # [k]
    return Chosen(chosen, int(chosen.numel()), sel.num_groups)


def first_in_step_order(candidates: Sequence[Sequence[int]], room: int) -> list[list[int]]:
    """Every rank's informative groups, each named by its position in the step's order -> per rank, the indices
    (into its own list, ascending) of those among the ``room`` first of the step: what one process would keep of the
    round the ranks sampled together."""
    ranked = sorted((pos, rank, i) for rank, positions in enumerate(candidates) for i, pos in enumerate(positions))
    taken: list[list[int]] = [[] for _ in candidates]
    for _, rank, i in ranked[:room]:
        taken[rank].append(i)
    return [sorted(t) for t in taken]


def fill_batch(
    sample_fn: Callable[[], SampledGroups | tuple],
    target_groups: int,
    max_extra_rounds: int,
    *,
    tol: float = 0.0,
    choose: Callable[[GroupSelection, SampledGroups, int], Chosen] = choose_first,
) -> FillResult:
    """Call ``sample_fn()`` until ``target_groups`` informative groups are kept or ``max_extra_rounds`` extra rounds
    (after the first) are spent.

    ``sample_fn`` returns :class:`SampledGroups` or a ``(rewards, group_ids[, payload])`` tuple. Groups beyond the
    target are dropped in order of appearance (:func:`choose_first`; with several ranks ``choose`` decides over the
    step, and the counts, hence the rounds, are the step's on every rank). If the rounds run out first the result is
    partial (``full`` is False, ``fill_rate`` < 1) and the trainer decides whether to train on it; ``num_groups`` 0
    means no informative group was found at all (an empty ``parts`` list with more: the others' shares kept them).
    """
    if target_groups < 1 or max_extra_rounds < 0:
        raise ValueError(f"need target_groups >= 1 and max_extra_rounds >= 0; got {target_groups}, {max_extra_rounds}")
    result = FillResult(target_groups=target_groups)
    while result.num_groups < target_groups and result.rounds <= max_extra_rounds:
        batch = sample_fn()
        if not isinstance(batch, SampledGroups):
            batch = SampledGroups(*batch)
        result.rounds += 1
        sel = filter_groups(batch.rewards, batch.group_ids, tol=tol)
        chosen = choose(sel, batch, target_groups - result.num_groups)
        result.sampled_groups += chosen.sampled
        result.num_groups += chosen.kept
        if chosen.group_ids.numel() == 0:
            continue
        ids = torch.as_tensor(batch.group_ids).to(chosen.group_ids.device)
        indices = torch.nonzero(torch.isin(ids, chosen.group_ids)).squeeze(-1)  # [n]
        result.parts.append(KeptPart(payload=batch.payload, indices=indices, group_ids=chosen.group_ids))
    return result
