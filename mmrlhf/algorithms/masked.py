"""Masked reductions over response tokens, and the loss aggregation modes.

Every tensor here is ``[B, A]`` (batch, response length) with a mask that is 1 (or True) on response tokens.
Masked positions are *selected away* with ``torch.where`` rather than multiplied by zero: padding may hold
garbage (even NaN/inf from a model's padded logits) and ``nan * 0`` is still NaN, in the forward pass and, worse,
in the backward pass. An empty mask is a defined case everywhere: reductions over nothing return 0, never NaN.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def as_bool_mask(mask: Tensor) -> Tensor:
    """The mask as a bool tensor (callers pass 0/1 floats or ints as often as bools)."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where the mask is set, exactly 0 elsewhere (NaN-safe, gradient 0 at masked positions)."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over masked positions (all of them, or along ``dim``)."""
    x = masked_fill_zero(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    m = as_bool_mask(mask)
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked positions; 0 where there are none (an empty mask has no mean, and 0 is the neutral value
    for every use here: a loss, a metric, a centring shift)."""
    n = masked_count(mask, dim).to(x.dtype)
    return masked_sum(x, mask, dim) / n.clamp(min=1)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", *, norm_len: int | None = None,
             denominator: float | Tensor | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, A]`` to a scalar.

    - ``token-mean``: sum over all response tokens / number of response tokens. Every token weighs the same, so
      long responses weigh more (DAPO's choice).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean. Every sequence weighs the same,
      so a token of a short response weighs more (the original GRPO objective).
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum (grows with length).
    - ``seq-mean-token-sum-norm``: mean over sequences of (token sum / ``norm_len``), ``norm_len`` a constant
      (default: the padded length ``A``; pass the configured maximum response length to keep it constant across
      batches, as Dr. GRPO intends). No length bias, and the scale stays bounded.

    Sequences with no response token are left out of the sequence means (they carry no loss and must not dilute
    the others); with no response token at all the loss is 0 (still attached to the graph).

    ``denominator``: divide by this instead of the batch's own count (response tokens for ``token-mean``,
    sequences with a response token otherwise). Gradient accumulation passes the count of the whole mini-batch, so
    the micro-batch losses sum to exactly the mini-batch's loss; see :func:`agg_count`.
    """
    m = as_bool_mask(mask)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGG_MODES)}")
    if denominator is not None:
        denom = torch.as_tensor(denominator, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)
        if mode == "token-mean":
            return masked_sum(loss_mat, m) / denom
        return _per_sequence(loss_mat, m, mode, norm_len).sum() / denom
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    nonempty = m.sum(-1) > 0  # [B]
    return masked_mean(_per_sequence(loss_mat, m, mode, norm_len), nonempty)


def agg_count(mask: Tensor, mode: str = "token-mean") -> Tensor:
    """What :func:`agg_loss` divides by for ``mask``: response tokens (``token-mean``) or sequences with at least
    one response token (the sequence modes). Summed over micro-batches it is the mini-batch's ``denominator``."""
    m = as_bool_mask(mask)
    return m.sum() if mode == "token-mean" else (m.sum(-1) > 0).sum()


def _per_sequence(loss_mat: Tensor, m: Tensor, mode: str, norm_len: int | None) -> Tensor:
    """[B] per-sequence loss of a sequence mode (0 for sequences without response tokens)."""
    seq_sum = masked_sum(loss_mat, m, dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        return seq_sum / m.sum(-1).clamp(min=1).to(loss_mat.dtype)
    if mode == "seq-mean-token-sum":
        return seq_sum
    denom = max(loss_mat.shape[-1], 1) if norm_len is None else norm_len
    if denom <= 0:
        raise ValueError(f"norm_len must be positive, got {denom}")
    return seq_sum / denom
