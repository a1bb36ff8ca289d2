"""On-policy distillation: a teacher scores the student's own samples, token by token.

The student samples responses (images included); a teacher of the same tokenizer (in real recipes a larger model
of the same family) returns the log-probability of each sampled token. Per token, the reverse KL
``KL(pi_student || pi_teacher)`` is estimated on the student's own sample by ``log pi_s(x_t) - log pi_t(x_t)``
(the ``k1`` estimator of :mod:`mmrlhf.algorithms.kl`, with the teacher in the reference's place). Following
Thinking Machines' "On-Policy Distillation" (Lu et al., 2025), its NEGATIVE is the token's advantage, undiscounted
and not summed over later tokens (discount 0: each token is graded for itself):

    A_distill[b, t] = coef * (log pi_teacher(x_t) - log pi_student(x_t))     on the action mask, 0 elsewhere

so a token the teacher finds more likely than the student did is pushed up, one it finds less likely is pushed down.
It is an ADVANTAGE, not a loss term: it goes through the usual importance-sampled (clipped) policy-gradient loss, and
``log pi_student`` is the behaviour policy's score at sampling time (a constant, as every advantage is).

Mixed with task rewards the two are added per token: ``A = A_task + A_distill`` with ``A_task`` the configured
estimator's (e.g. the group-normalised GRPO advantage, broadcast over the response); ``coef`` weighs the teacher
against the task. Distillation alone is the task advantage set to zero (the ``distill`` estimator below).

No baseline is subtracted (as the peers train it): the advantage's mean over the student's own tokens is minus the
reverse KL, which falls to 0 as the student matches the teacher.
"""

from __future__ import annotations

from torch import Tensor

from mmrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS
from mmrlhf.algorithms.masked import as_bool_mask, masked_fill_zero

DISTILL_ESTIMATOR = "distill"


def reverse_kl_advantages(student_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor, *,
                          coef: float = 1.0) -> Tensor:
    """``[B, A]`` distillation advantages ``coef * (teacher - student)`` on the mask, exactly 0 elsewhere.

    ``student_log_probs`` / ``teacher_log_probs`` ``[B, A]``: each model's log-prob of the sampled token (the
    student's at sampling time). Values off the mask are never read (padding may hold ``-inf``: selected away
    before subtracting, as ``inf - inf`` is NaN)."""
    if student_log_probs.shape != teacher_log_probs.shape or student_log_probs.shape != mask.shape:
        raise ValueError(f"student_log_probs {tuple(student_log_probs.shape)}, teacher_log_probs "
                         f"{tuple(teacher_log_probs.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if coef < 0:
        raise ValueError(f"distillation coefficient must be >= 0, got {coef}")
    m = as_bool_mask(mask)
    diff = masked_fill_zero(teacher_log_probs, m) - masked_fill_zero(student_log_probs, m)  # [B, A]
    return (coef * diff).detach()


def mix_advantages(task_advantages: Tensor, distill_advantages: Tensor, mask: Tensor) -> Tensor:
    """``[B, A]`` task advantages plus distillation advantages on the mask (0 elsewhere)."""
    if task_advantages.shape != distill_advantages.shape or task_advantages.shape != mask.shape:
        raise ValueError(f"task {tuple(task_advantages.shape)}, distill {tuple(distill_advantages.shape)} and mask "
                         f"{tuple(mask.shape)} advantages must have the same shape")
    m = as_bool_mask(mask)
    return masked_fill_zero(task_advantages, m) + masked_fill_zero(distill_advantages, m)


def distill_metrics(student_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor) -> dict[str, float]:
    """``distill/reverse_kl``: mean over the masked tokens of ``log pi_s - log pi_t`` (the k1 estimate of the
    per-token reverse KL; it falls as the student matches the teacher); ``distill/teacher_logprob``: the teacher's
    mean log-prob of the student's tokens. Empty mask: both 0."""
    m = as_bool_mask(mask)
    n = int(m.sum())
    if n == 0:
        return {"distill/reverse_kl": 0.0, "distill/teacher_logprob": 0.0}
    s, t = student_log_probs[m].double(), teacher_log_probs[m].double()
    return {"distill/reverse_kl": float((s - t).sum() / n), "distill/teacher_logprob": float(t.sum() / n)}


@ADVANTAGE_ESTIMATORS.register(DISTILL_ESTIMATOR)
def zero_task_advantages(token_rewards: Tensor, mask: Tensor, *, values: Tensor | None = None,
                         group_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Distillation alone: the task advantage (and return) is 0 for every token, so only the teacher trains the
    student: its advantage, added by the experience maker with ``algorithm.distill_coef``, and / or its top-k loss
    term (``algorithm.distill_loss_coef``, :mod:`mmrlhf.algorithms.distill_topk`). Rewards are still computed
    and logged (the task's eval reward is what the distillation is judged by)."""
    zeros = token_rewards.new_zeros(token_rewards.shape)  # [B, A]
    return zeros, zeros.clone()
