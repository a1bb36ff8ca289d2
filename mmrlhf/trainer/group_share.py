"""A rank's part of what its engine group generated (``rollout.tensor_parallel_size`` > 1 under torchrun).

Every rank of a group generates the group's prompts (:mod:`mmrlhf.parallel.engine_groups`) and keeps the samples of
the records it trains: the groups of samples whose prompt it owns, renumbered in order, so that its part is what it
would have generated with an engine of its own (``rank::world`` prompts, in order). The group's generation and reward
metrics describe the group's samples on every member: means and rates are the group's on each (the step's merge
weights them by each part's ``samples``), counts are kept by the group's first rank alone (``samples``: each part's
own), so the step's sums count every prompt and sample once; the group's skip lines likewise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from mmrlhf.experience.rollout import ScoredRollout, is_count_metric


def member_part(rollout: ScoredRollout, positions: Mapping[int, int], owners: Sequence[int], rank: int,
                lead: bool) -> ScoredRollout:
    """The samples of ``rollout`` (the group's) whose prompt ``rank`` trains. ``positions``: group id -> its
    prompt's position among those the group asked for; ``owners[p]``: the rank that trains prompt ``p``; ``lead``:
    this rank keeps the group's counts and skip lines."""
    rows = [i for i, g in enumerate(rollout.rows.group) if owners[positions[g]] == rank]
    part = rollout.select(rows)
    renumber: dict[int, int] = {}
    groups = [renumber.setdefault(g, len(renumber)) for g in part.rows.group]
    part.rows = dataclasses.replace(part.rows, group=groups)
    part.metrics = part_metrics(rollout.metrics, len(part), lead)
    part.skipped = list(rollout.skipped) if lead else []
    return part


def part_metrics(metrics: Mapping[str, float], samples: int, lead: bool) -> dict[str, float]:
    """The group's metrics as one member reports them (see the module's docstring)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "samples":
            out[key] = float(samples)
        elif is_count_metric(key):
            out[key] = float(value) if lead else 0.0
        else:
            out[key] = float(value)
    return out


def owned_ids(asked: Sequence[Any], owners: Sequence[int], rank: int) -> list[Any]:
    """The record ids of the prompts ``rank`` trains, in order (the ids its own share would have asked for)."""
    return [rid for rid, owner in zip(asked, owners) if owner == rank]
