"""Token entropy and high-entropy token filtering (Wang et al. 2025, "Beyond the 80/20 rule", arXiv 2506.01939).

That paper finds that the policy gradient of reasoning RL is carried by a minority of "forking" tokens, those
where the policy is uncertain, and that restricting the gradient to the top 20% of tokens by entropy matches
or beats full-token training. :func:`high_entropy_mask` returns the mask to hand to the policy loss.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmrlhf.algorithms.masked import as_bool_mask


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dimension, ``[..., V] -> [...]``.

    ``H = logsumexp(z) - sum softmax(z) * z``: one softmax and no ``log(0)``, so a -inf logit (a masked-out
    vocabulary entry) contributes 0 instead of NaN.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., 1]
    p = torch.exp(logits - lse)  # [..., V]
    pz = torch.where(p > 0, p * logits, torch.zeros_like(p))  # [..., V]
    return (lse.squeeze(-1) - pz.sum(-1))


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_p: float = 0.2) -> Tensor:
    """Bool mask ``[B, A]`` keeping the ``ceil(top_p * n)`` highest-entropy response tokens of the batch.

    ``n`` counts the response tokens of the whole batch (the paper ranks tokens batch-wide, not per response).
    Exactly that many are kept: ties at the threshold are broken by position (a stable sort), so the kept
    fraction never drifts up on degenerate, all-equal entropies. ``top_p = 1`` returns the mask itself; an empty
    mask returns an empty mask. Not differentiable (a selection).
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    m = as_bool_mask(mask)
    if top_p == 1.0:
        return m.clone()
    flat_m = m.flatten()  # [B*A]
    n = int(flat_m.sum())
    k = math.ceil(top_p * n)
    keep = torch.zeros_like(flat_m)
    if k == 0:
        return keep.view_as(m)
    neg_inf = torch.full(flat_m.shape, -float("inf"), device=flat_m.device)
    scores = torch.where(flat_m, entropy.detach().flatten().float(), neg_inf)  # [B*A]
    scores = torch.nan_to_num(scores, nan=-float("inf"))
    order = torch.sort(scores, descending=True, stable=True).indices[:k]  # [k]
    keep[order] = True
    return (keep & flat_m).view_as(m)
