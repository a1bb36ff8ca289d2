"""Per-group statistics over samples that share a prompt, vectorised with ``index_add`` / ``scatter_reduce``.

Group ids may be any integers (not necessarily 0..G-1, not contiguous, not sorted) and groups may have uneven
sizes (a prompt whose samples were filtered, a rollout that skipped one): ``torch.unique(return_inverse=True)``
maps them to dense indices and every statistic is one scatter over the batch, never a Python loop over groups.

Statistics are computed in float64: they are ``[G]``-sized (cheap even on an accelerator) and float32 sums of
rewards would leave ``r - mean`` with ~1e-8 of noise that a later division by a small std blows up. Zero-variance
groups are nevertheless detected exactly (max == min), since even float64 gives 0.1 * 3 / 3 != 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def isolate_invalid(group_ids: Tensor, valid: Tensor) -> Tensor:
    """``[N]`` group ids where every sample the reward engine masked out (``valid`` False) has a group of its own:
    a singleton has no spread, so a masked sample's placeholder reward never fakes variance in its prompt's group
    (group filtering) nor enters its group's statistics (advantages). The one place this rule is decided."""
    if not group_ids.numel():  # a share with no sample (every prompt skipped)
        return group_ids
    alone = group_ids.max() + 1 + torch.arange(len(group_ids), device=group_ids.device)  # [N] fresh ids
    return torch.where(valid, group_ids, alone)


@dataclass(frozen=True)
class GroupStats:
    """Statistics of one ``[N]`` vector of sequence-level values split by group, each gathered back to ``[N]``."""

    index: Tensor  # [N] dense group index 0..G-1 of each sample
    num_groups: int
    count: Tensor  # [N] size of the sample's group (float64)
    sum: Tensor  # [N] group sum (float64)
    mean: Tensor  # [N] group mean (float64)
    std: Tensor  # [N] group std, unbiased (n - 1); 0 for a group of size 1 (float64)
    pop_std: Tensor  # [N] group std, population (n); 0 for a group of size 1 (float64)
    constant: Tensor  # [N] bool: every value of the group is equal (includes groups of size 1)


def dense_group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer ids ``[N]`` to dense indices ``[N]`` in ``0..G-1`` and return ``G``."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D [B], got shape {tuple(group_ids.shape)}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def group_stats(values: Tensor, group_ids: Tensor) -> GroupStats:
    """Group count, sum, mean, std (both flavours) and constancy of ``values`` ``[N]``, gathered per sample."""
    if values.shape != group_ids.shape:
        raise ValueError(f"values {tuple(values.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    idx, g = dense_group_index(group_ids.to(values.device))
    v = values.to(torch.float64)  # [N]
    zeros = torch.zeros(g, dtype=torch.float64, device=v.device)  # [G]
    count = zeros.index_add(0, idx, torch.ones_like(v))  # [G]
    total = zeros.index_add(0, idx, v)  # [G]
    mean = total / count.clamp(min=1)  # [G]
    sq_dev = zeros.index_add(0, idx, (v - mean[idx]) ** 2)  # [G]
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # [G]
    pop_std = (sq_dev / count.clamp(min=1)).sqrt()  # [G]
    hi = torch.full((g,), -float("inf"), dtype=torch.float64, device=v.device).scatter_reduce(
        0, idx, v, reduce="amax", include_self=True
    )  # [G]
    lo = torch.full((g,), float("inf"), dtype=torch.float64, device=v.device).scatter_reduce(
        0, idx, v, reduce="amin", include_self=True
    )  # [G]
    constant = hi <= lo  # [G]
    return GroupStats(
        index=idx,
        num_groups=g,
        count=count[idx],
        sum=total[idx],
        mean=mean[idx],
        std=torch.where(constant, torch.zeros_like(std), std)[idx],
        pop_std=torch.where(constant, torch.zeros_like(pop_std), pop_std)[idx],
        constant=constant[idx],
    )
