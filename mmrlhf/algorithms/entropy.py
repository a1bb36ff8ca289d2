"""Token entropy and high-entropy token filtering (Wang et al. 2025, "Beyond the 80/20 rule", arXiv 2506.01939).

That paper finds that the policy gradient of reasoning RL is carried by a minority of "forking" tokens, those
where the policy is uncertain, and that restricting the gradient to the top 20% of tokens by entropy matches
or beats full-token training. :func:`high_entropy_mask` returns the mask to hand to the policy loss.
"""

from __future__ import annotations

import math
from typing import Sequence

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


def masked_scores(entropy: Tensor, mask: Tensor) -> Tensor:
    """The entropies of the masked tokens in position order, float32, NaN as -inf (a NaN ranks last): what
    :func:`high_entropy_mask` ranks, and what each training rank contributes to the step's ranking."""
    m = as_bool_mask(mask)
    return torch.nan_to_num(entropy.detach().float()[m], nan=-float("inf"))


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_p: float = 0.2, *,
                      step_scores: Sequence[Tensor] | None = None, rank: int = 0) -> Tensor:
    """Bool mask ``[B, A]`` keeping the ``ceil(top_p * n)`` highest-entropy response tokens of the step.

    ``n`` counts the response tokens of the whole step (the paper ranks tokens batch-wide, not per response).
    Exactly that many are kept: ties at the threshold are broken by position (a stable sort), so the kept fraction
    never drifts up on degenerate, all-equal entropies. ``step_scores``: with several training ranks, every rank's
    :func:`masked_scores` in rank order (this batch's at ``rank``); the threshold is then the step's, and tokens tied
    at it are taken in rank order, then by position (None: this batch is the step). ``top_p = 1`` returns the mask
    itself; an empty mask returns an empty mask. Not differentiable (a selection).
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    m = as_bool_mask(mask)
    if top_p == 1.0:
        return m.clone()
    mine = masked_scores(entropy, m)  # [n_r]
    scores = [mine] if step_scores is None else [s.to(mine.device) for s in step_scores]
    threshold, tied = entropy_cut(torch.cat(scores), top_p)
    if threshold is None:
        return torch.zeros_like(m)
    before = sum(int((s == threshold).sum()) for s in scores[:rank])  # tied tokens of the ranks before this one
    at = mine == threshold
    keep = (mine > threshold) | (at & (torch.cumsum(at.long(), 0) + before <= tied))
    out = torch.zeros_like(m)
    out[m] = keep
    return out


def entropy_cut(scores: Tensor, top_p: float) -> tuple[Tensor | None, int]:
    """(threshold, ties): the ``ceil(top_p * n)`` highest of ``scores`` are those above ``threshold`` and the first
    ``ties`` equal to it; (None, 0) when none is kept."""
    k = math.ceil(top_p * scores.numel())
    if k == 0:
        return None, 0
    threshold = torch.topk(scores, k).values[-1]
    return threshold, k - int((scores > threshold).sum())
