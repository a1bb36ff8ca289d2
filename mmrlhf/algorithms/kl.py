"""KL between the policy and the reference model: per-token estimators, the two ways to use them, controllers.

The estimators (Schulman, "Approximating KL divergence", 2020) estimate ``KL(pi || pi_ref)`` from tokens sampled
from ``pi``, with ``log_ratio = logprobs - ref_logprobs``:

- ``k1 = log_ratio``: unbiased, high variance, can be negative per token;
- ``k2 = log_ratio**2 / 2``: biased (low for close policies), low variance, never negative;
- ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased and never negative (the GRPO paper's choice).

KL is used either folded into the reward (``kl_penalized_rewards``: ``r_t - beta * kl_t`` per token, beta from a
:class:`FixedKLController` or :class:`AdaptiveKLController`; the classic RLHF set-up, where the KL is part of
what the advantage estimator sees) or as a loss term (``kl_loss``: differentiated directly, as GRPO does). Both
can be on at once. The log-ratio is clamped to ``[-20, 20]`` before exponentiating: beyond that the policies have
nothing in common and ``exp`` would overflow to inf (and then NaN in the gradient).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mmrlhf.algorithms.masked import agg_loss, as_bool_mask, masked_fill_zero, masked_mean

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0


def approx_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` ``[B, A]``, 0 outside the mask. Differentiable in ``logprobs``."""
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same shape"
        )
    m = as_bool_mask(mask)
    # select before subtracting: padding may hold -inf log-probs, and inf - inf is NaN
    log_ratio = masked_fill_zero(logprobs, m) - masked_fill_zero(ref_logprobs, m)  # [B, A]
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return masked_fill_zero(kl, m)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k3",
    agg: str = "token-mean",
    norm_len: int | None = None,
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL as a loss term (to be multiplied by its coefficient by the caller), aggregated like the policy loss
    (``denominator``: see ``masked.agg_loss``, for gradient accumulation)."""
    kl = approx_kl(logprobs, ref_logprobs, mask, estimator)  # [B, A]
    loss = agg_loss(kl, mask, agg, norm_len=norm_len, denominator=denominator)
    return loss, {"kl_loss": loss.detach()}


def kl_penalized_rewards(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    *,
    estimator: str = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """``r_t - coef * kl_t`` on response tokens ``[B, A]`` (0 elsewhere), without gradient.

    ``k1`` is the usual choice here: summed over a response it is the sample's log-likelihood ratio, an unbiased
    estimate of the sequence KL that a per-token reward can carry. Metrics: ``kl`` (mean per-token estimate),
    ``kl_seq`` (mean per-response sum over responses with at least one token, what the adaptive controller tracks)
    and ``kl_coef``.
    """
    with torch.no_grad():
        m = as_bool_mask(mask)
        kl = approx_kl(logprobs, ref_logprobs, m, estimator)  # [B, A]
        out = masked_fill_zero(token_rewards - coef * kl, m)
        seq_kl = kl.sum(-1)  # [B]
        # Rows without a response token (samples the reward engine masked out) carry no KL: they must not pull the
        # mean, and with it the adaptive controller, towards 0.
        metrics = {
            "kl": masked_mean(kl, m),
            "kl_seq": masked_mean(seq_kl, m.any(-1)),
            "kl_coef": torch.tensor(float(coef), device=kl.device),
        }
    return out, metrics


class FixedKLController:
    """A constant KL coefficient (same interface as the adaptive one, so the trainer need not tell them apart)."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 ("Fine-tuning LMs from human preferences", sec. 2.2).

    After each batch, ``e = clip(KL / target - 1, -0.2, 0.2)`` and ``beta *= 1 + e * n_steps / horizon``: beta grows
    while the measured KL exceeds the target and shrinks below it, with at most a 20% proportional error so one
    outlier batch cannot swing it. ``current_kl`` is the per-response KL (``kl_seq`` above) and ``n_steps`` the
    number of samples in the batch, as in the paper's units.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"need init_coef >= 0, target > 0, horizon > 0; got {init_coef}, {target}, {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        # a batch larger than horizon / 0.2 could flip the sign; a KL penalty must never become a KL bonus
        self.value *= max(1.0 + error * n_steps / self.horizon, 0.0)
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def kl_controller(kind: str, coef: float, *, target: float = 6.0, horizon: int = 10000):
    """``"fixed"`` or ``"adaptive"`` controller starting at ``coef``."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: fixed, adaptive")
