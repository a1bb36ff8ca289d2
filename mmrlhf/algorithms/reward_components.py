"""Per-component reward normalisation (GDPO, Liu et al. 2026, arXiv 2601.05242): z-score each recipe term within its
group before the weighted sum.

Why: a recipe's terms have unrelated scales and spreads. Summed raw, the term that varies most within a group
decides the group's ranking: a 0/1 format reward swinging between samples drowns a correctness score in
``[0, 0.1]``, whatever the weights say, and distinct combinations of terms collapse onto the same advantage. Each
term brought to unit spread within the group first lets the weights say how much each one counts.

For a group g and a component c, over the samples of g where c has a score::

    z_c = (s_c - mean_g(s_c)) / (std_g(s_c) + eps)      (std unbiased, as grpo's; 0 where c is constant in g)
    reward = sum_c w_c z_c

A missing score (NaN: the sample's recipe has no such term, or the source said "does not apply") is left out of its
component's statistics and contributes 0; so does a weight of 0. Statistics are float64 over ``[N]`` vectors, one
pass per component (components are few; never a loop over groups), with :func:`~mmrlhf.algorithms.groups.group_stats`
deciding constancy exactly (max == min), so rounding noise is never divided by ``eps``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrlhf.algorithms.groups import group_stats


def per_component_rewards(scores: Tensor, weights: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """``[N]`` rewards ``sum_c w_c z_c`` from ``scores`` ``[N, C]`` (NaN: no score), ``weights`` ``[N, C]`` (each
    sample's recipe weight of each component, 0 where the term is not in its recipe) and ``group_ids`` ``[N]``.

    Weights are per sample, so samples of different labels (different recipes) may share a group: a component's
    statistics pool the samples that have a score for it, and each sample weighs its z-score by its own recipe."""
    if scores.dim() != 2 or scores.shape != weights.shape or tuple(group_ids.shape) != (scores.shape[0],):
        raise ValueError(f"scores and weights must be [N, C] and group_ids [N]; got {tuple(scores.shape)}, "
                         f"{tuple(weights.shape)}, {tuple(group_ids.shape)}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    s = scores.to(torch.float64)  # [N, C]
    w = weights.to(device=s.device, dtype=torch.float64)  # [N, C]
    group_ids = group_ids.to(s.device)  # [N]
    present = ~torch.isnan(s) & (w != 0)  # [N, C]
    out = torch.zeros(s.shape[0], dtype=torch.float64, device=s.device)  # [N]
    for c in range(s.shape[1]):
        rows = present[:, c].nonzero().squeeze(-1)  # [n_c]
        if not rows.numel():
            continue
        st = group_stats(s[rows, c], group_ids[rows])  # over the samples that have a score for c
        z = (s[rows, c] - st.mean) / (st.std + eps)  # [n_c]
        z = torch.where(st.constant, torch.zeros_like(z), z)
        out = out.index_add(0, rows, w[rows, c] * z)
    return out
