"""On-policy distillation as a LOSS TERM over the teacher's top-k tokens: the student is pulled towards the teacher's
whole next-token distribution at each of its own response positions, not only graded on the one token it sampled.

Why beside the per-token advantage of :mod:`mmrlhf.algorithms.distill`: that advantage reads one sampled token per
position, so a student that almost never samples the teacher's tokens (a randomly initialised one) learns only that
its own tokens are unlikely, and pushing them down spreads its mass everywhere. Here, as in GKD (Agarwal et al.,
2024, on-policy generalised knowledge distillation) and the top-k logit distillation of the peers, the teacher's
distribution at every position the student visited is the target, the teacher's best tokens included.

What is kept: at scoring time the teacher's ``k`` largest log-probs and their ids per response position
(``[B, A, k]``, never ``[B, A, V]``); in the update the student's log-probs at those same ids, from its logits at the
response positions (:func:`mmrlhf.models.logprobs.chunked_sampled_log_probs`, ``extra_targets``). Both
distributions are then COARSENED to ``k + 1`` outcomes: the ``k`` teacher tokens, and "any other token", whose
probability is the rest of the mass (``1 - sum of the k``, each model its own). The loss is the exact KL of these two
coarsened distributions, per token:

    reverse:  KL(s || t) = sum_{i in K} s_i (log s_i - log t_i) + r_s (log r_s - log r_t)
    forward:  KL(t || s) = sum_{i in K} t_i (log t_i - log s_i) + r_t (log r_t - log r_s)

with ``s_i`` / ``t_i`` the student's / teacher's probabilities of the teacher's i-th token, ``r_s`` / ``r_t`` their
tail masses. Why coarsened rather than the top-k renormalised or the tail spread uniformly: it is a true KL (>= 0,
0 exactly when the coarsened distributions agree), so at teacher == student the loss AND its gradient are exactly
0; by the data-processing inequality it never exceeds the full-vocabulary KL, and equals it when the teacher puts
no mass outside its top-k; no assumption on how either model spreads its tail is made.

Directions: ``reverse`` (mode-seeking, the one the advantage of :mod:`mmrlhf.algorithms.distill` estimates) pushes
the student's mass out of the tail bucket and onto the teacher's tokens, with a gradient proportional to the
student's own probability of each token; ``forward`` (mass-covering, the supervised-KD direction, GKD's beta = 0)
gives the logits the gradient ``p_student - p_teacher`` on the teacher's tokens (the cross-entropy gradient, the
teacher's tail ignored once it is ~0), which does not vanish where the student gives a teacher token almost nothing.
On the toy task (a random student, docs/algorithms.md) forward reached the teacher's greedy eval reward 20 steps
before reverse, their sampled rewards alike; both 50+ steps before GRPO alone.

Tail masses are floored at ``TAIL_FLOOR``: the inputs are float32 log-probs, whose sum over ``k`` tokens resolves
the rest of the mass only to ~1e-7, so a smaller tail is rounding, and its log would be noise (or -inf).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmrlhf.algorithms.masked import as_bool_mask, masked_fill_zero, masked_mean

KL_DIRECTIONS = ("reverse", "forward")
TAIL_FLOOR = 1e-6  # smallest tail mass told apart from 0 (module docstring)


def _with_tail(log_probs: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, A, k]`` log-probs of the teacher's tokens -> their probabilities ``[B, A, k]`` and the log of the rest
    of the mass ``[B, A]`` (floored), float64."""
    lp = log_probs.double()
    rest = -torch.expm1(torch.logsumexp(lp, dim=-1))  # [B, A] 1 - sum_k p, exact near 0 and near 1
    return lp.exp(), rest.clamp_min(TAIL_FLOOR).log()


def topk_kl(student_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor, *,
            direction: str = "reverse") -> Tensor:
    """``[B, A]`` per-token KL of the coarsened distributions (module docstring) on the mask, exactly 0 elsewhere,
    differentiable in ``student_log_probs``; in the students' dtype.

    ``student_log_probs`` / ``teacher_log_probs`` ``[B, A, k]``: each model's log-prob of the teacher's k tokens at
    each response position (the teacher's are constants). Values off the mask are never read (padding may hold 0 or
    ``-inf``): replaced by one shared distribution before any arithmetic, so no NaN reaches the gradient."""
    if student_log_probs.shape != teacher_log_probs.shape or student_log_probs.shape[:-1] != mask.shape:
        raise ValueError(f"student_log_probs {tuple(student_log_probs.shape)} and teacher_log_probs "
                         f"{tuple(teacher_log_probs.shape)} must be [B, A, k] over a mask [B, A], got mask "
                         f"{tuple(mask.shape)}")
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"algorithm.distill_loss_kl must be one of {KL_DIRECTIONS}, got {direction!r}")
    m = as_bool_mask(mask)[..., None]  # [B, A, 1]
    filler = torch.tensor(-math.log(student_log_probs.shape[-1] + 1), dtype=student_log_probs.dtype,
                          device=student_log_probs.device)  # off the mask: k + 1 equal outcomes for both models
    s_lp = torch.where(m, student_log_probs, filler)  # [B, A, k]
    t_lp = torch.where(m, teacher_log_probs.detach().to(student_log_probs.dtype), filler)  # [B, A, k]
    s_p, s_rest = _with_tail(s_lp)
    t_p, t_rest = _with_tail(t_lp)
    diff, rest_diff = s_lp.double() - t_lp.double(), s_rest - t_rest  # [B, A, k], [B, A]
    if direction == "reverse":
        kl = (s_p * diff).sum(-1) + s_rest.exp() * rest_diff  # [B, A]
    else:
        kl = -(t_p * diff).sum(-1) - t_rest.exp() * rest_diff  # [B, A]
    return masked_fill_zero(kl, m[..., 0]).to(student_log_probs.dtype)


def topk_metrics(kl: Tensor, teacher_log_probs: Tensor, mask: Tensor) -> dict[str, float]:
    """``distill_topk_kl``: mean per-token coarsened KL over the mask; ``distill_teacher_topk_mass``: the mean mass
    the teacher puts on its top-k (near 1: the coarsened KL is nearly the full one). Empty mask: both 0."""
    m = as_bool_mask(mask)
    mass = teacher_log_probs.detach().double().logsumexp(-1).exp()  # [B, A]
    return {"distill_topk_kl": float(masked_mean(kl.detach().double(), m)),
            "distill_teacher_topk_mass": float(masked_mean(mass, m))}
