"""Dealing a step's prompt groups to training ranks by their cost (the Ray mode's trainer ranks).

Why by cost: every optimiser step waits for the slowest rank (FSDP's collectives pair the ranks' forwards and
backwards), so a rank dealt the groups with the large images and the long answers sets the step's time. Dealing
round-robin gives each rank as many groups, whatever they hold; here the groups are dealt longest first, each to the
least-loaded rank that still has room (longest-processing-time rule), and every rank still gets as many groups as
round-robin would give it (``ceil`` or ``floor`` of groups / ranks): the mini-batch arithmetic of the update
(``train_batch_size / ranks`` samples per rank and optimiser step) stays as it was.

A group's cost is what its forwards compute: the tokens of its samples (prompt and response) plus the vision patch
rows of their images and videos (:func:`~mmrlhf.experience.costs.patch_rows`), the same units as the micro-batch
planner's (:mod:`mmrlhf.parallel.micro_batches`).
"""

from __future__ import annotations

from typing import Sequence


def deal_by_cost(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank of each group (``costs[g]``: group ``g``'s cost): longest first to the least-loaded rank with room,
    ties to the lower rank and, among equal costs, the earlier group first (deterministic). Rank ``r`` gets
    ``ceil`` of groups / ranks groups if ``r < groups % ranks``, else ``floor``, as round-robin dealing would."""
    if ranks < 1:
        raise ValueError(f"deal_by_cost: {ranks} ranks")
    n = len(costs)
    room = [n // ranks + (1 if r < n % ranks else 0) for r in range(ranks)]
    load = [0.0] * ranks
    out = [0] * n
    for g in sorted(range(n), key=lambda i: (-costs[i], i)):
        rank = min((r for r in range(ranks) if room[r] > 0), key=lambda r: (load[r], r))
        out[g] = rank
        load[rank] += costs[g]
        room[rank] -= 1
    return out


def imbalance(costs: Sequence[float], ranks_of: Sequence[int], ranks: int) -> float:
    """The most-loaded rank's cost over the mean rank's (1.0: perfectly even; 0 groups: 1.0)."""
    load = [0.0] * ranks
    for cost, rank in zip(costs, ranks_of):
        load[rank] += cost
    mean = sum(load) / ranks
    return max(load) / mean if mean > 0 else 1.0
