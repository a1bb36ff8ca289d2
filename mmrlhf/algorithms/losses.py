"""Policy losses (one registry, one entry point :func:`policy_loss`) and the clipped value loss.

A registered policy loss is ``fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, **params) ->
(per_token_loss [B, A], metrics)``; :func:`policy_loss` sanitises the inputs, calls it, aggregates the per-token
loss with the chosen mode (see ``masked.agg_loss``), adds the optional entropy bonus and the common metrics.
Keeping aggregation out of the individual losses makes every loss usable with every aggregation mode.

All tensors are ``[B, A]``. ``ratio = exp(logprobs - old_logprobs)`` with the log-ratio clamped to ``[-20, 20]``
(beyond that ``exp`` overflows to inf; a token that far off-policy gets no gradient through the clamp).
Metrics are detached 0-d tensors:

- ``pg_loss``: the aggregated policy loss (before the entropy bonus);
- ``clip_frac``: fraction of response tokens whose gradient the clipping removed (``cispo``: whose weight it
  clipped; ``ppo`` counts its dual clip apart, as ``dual_clip_frac``; ``sapo`` clips nothing and has none);
- ``approx_kl``: mean per-token ``KL(pi_old || pi)`` estimated with k3 on the sampled tokens,
  ``ratio - 1 - log ratio`` (non-negative and unbiased; it measures how far the update has moved);
- ``ratio_mean``, and ``entropy`` when entropies are passed; loss-specific extras listed per loss.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from mmrlhf.algorithms.checks import check_params
from mmrlhf.algorithms.kl import LOG_RATIO_CLAMP
from mmrlhf.algorithms.masked import agg_loss, as_bool_mask, masked_fill_zero, masked_mean
from mmrlhf.registry import Registry

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    norm_len: int | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_weights: Tensor | None = None,
    agg_denominator: float | Tensor | None = None,
    **params,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss (to minimise) and metrics, from the loss registered as ``name`` (or ``module:fn``).

    ``clip_low`` / ``clip_high`` bound the ratio to ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher uses
    ``clip_high > clip_low`` so low-probability tokens can still grow). ``entropy`` ``[B, A]`` with
    ``entropy_coef > 0`` subtracts ``entropy_coef * agg(entropy)`` (an exploration bonus). ``norm_len`` is the
    constant of ``seq-mean-token-sum-norm``. Pass a high-entropy mask (``entropy.high_entropy_mask``) as ``mask``
    to train on forking tokens only.

    ``token_weights`` ``[B, A]`` (no gradient) multiply the per-token loss before aggregation: the importance
    weights of rollout correction (``rollout_correction.rollout_correction``). ``agg_denominator`` replaces the
    aggregation's own count (tokens for ``token-mean``, non-empty sequences otherwise) so that gradient
    accumulation over micro-batches gives exactly the loss of the whole mini-batch (see ``masked.agg_loss``).
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape) or logprobs.dim() != 2:
        raise ValueError(
            "logprobs, old_logprobs, advantages and mask must all be [B, A]; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0; got {clip_low}, {clip_high}")
    fn = POLICY_LOSSES.get(name)
    check_params(fn, params, f"policy loss {name!r}")
    m = as_bool_mask(mask)
    # Sanitise once: padding may hold -inf / NaN, and where() keeps their gradient exactly 0.
    logprobs = masked_fill_zero(logprobs, m)
    old_logprobs = masked_fill_zero(old_logprobs.detach(), m)
    advantages = masked_fill_zero(advantages.detach(), m)
    per_token, metrics = fn(logprobs, old_logprobs, advantages, m, clip_low=clip_low, clip_high=clip_high, **params)
    if token_weights is not None:
        if token_weights.shape != per_token.shape:
            raise ValueError(f"token_weights must be [B, A] like the loss; got {tuple(token_weights.shape)}")
        per_token = per_token * masked_fill_zero(token_weights.detach().to(per_token.dtype), m)
    loss = agg_loss(per_token, m, agg, norm_len=norm_len, denominator=agg_denominator)
    out = {"pg_loss": loss.detach()}
    with torch.no_grad():
        log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        out["approx_kl"] = masked_mean(torch.expm1(log_ratio) - log_ratio, m)
        out["ratio_mean"] = masked_mean(log_ratio.exp(), m)
    if entropy is not None:
        ent = agg_loss(masked_fill_zero(entropy, m), m, agg, norm_len=norm_len, denominator=agg_denominator)
        out["entropy"] = ent.detach()
        if entropy_coef:
            loss = loss - entropy_coef * ent
    out.update({k: v.detach() for k, v in metrics.items()})
    return loss, out


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


@POLICY_LOSSES.register("ppo", aliases=("vanilla",))
def ppo(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip: float | None = None):
    """PPO's clipped surrogate, ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` per token.

    With ``A > 0`` the ratio is capped above (``r > 1 + clip_high`` gives a constant, zero gradient); with
    ``A < 0`` below (``r < 1 - clip_low``). Dual clip (Ye et al. 2020), ``dual_clip = c > 1``: for ``A < 0`` the
    loss is also capped at ``-c A``, so a token whose ratio exploded (``r > c``) cannot produce an unbounded
    update. Metrics: ``clip_frac`` (= ``clip_frac_high`` + ``clip_frac_low``) and ``dual_clip_frac``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    ratio = _ratio(logprobs, old_logprobs)  # [B, A]
    surr = -advantages * ratio  # [B, A]
    surr_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, A]
    loss = torch.maximum(surr, surr_clipped)
    clipped = surr_clipped > surr  # the constant branch is active: no gradient
    if dual_clip is not None:
        cap = -advantages * dual_clip  # [B, A]
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    else:
        dual = torch.zeros_like(clipped)
    metrics = {
        "clip_frac": masked_mean((clipped & ~dual).float(), mask),
        "clip_frac_high": masked_mean((clipped & (advantages > 0)).float(), mask),
        "clip_frac_low": masked_mean((clipped & (advantages < 0) & ~dual).float(), mask),
        "dual_clip_frac": masked_mean(dual.float(), mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(logprobs, old_logprobs, advantages, mask, *, clip_low=3e-4, clip_high=4e-4):
    """GSPO (Zheng et al. 2025): PPO clipping on the *sequence* ratio ``s_i = exp(mean_t log r_t)``.

    The token-level form of the paper (GSPO-token): ``s_{i,t} = sg(s_i) * pi_t / sg(pi_t)`` has the value of
    ``s_i`` and the gradient ``s_i * grad log pi_t``; with ``seq-mean-token-mean`` aggregation and one advantage
    per sequence this is exactly GSPO, and per-token advantages still work. Whole sequences are clipped
    together. The paper's clip ranges are ~1e-4 (sequence ratios stay near 1): the defaults used when called
    directly, but :func:`policy_loss` passes its own ``clip_low`` / ``clip_high``, so set them in config.
    Metrics: ``clip_frac`` (token fraction in clipped sequences), ``seq_ratio_mean``.
    """
    log_ratio = masked_fill_zero(logprobs - old_logprobs, mask)  # [B, A]
    n = mask.sum(-1).clamp(min=1).to(logprobs.dtype)  # [B]
    seq_log_ratio = (log_ratio.sum(-1) / n).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    s_tok = torch.exp(seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach())  # [B, A]
    surr = -advantages * s_tok
    surr_clipped = -advantages * s_tok.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(surr, surr_clipped)
    nonempty = mask.any(-1)
    metrics = {
        "clip_frac": masked_mean((surr_clipped > surr).float(), mask),
        "seq_ratio_mean": masked_mean(seq_log_ratio.detach().exp(), nonempty),
    }
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2):
    """CISPO (MiniMax-M1, 2025): clip the importance-sampling *weight*, never drop the token's gradient.

    ``loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi_t`` in the paper; implemented as
    ``-sg(clip(r)/r) * r * A`` which has the same gradient ``-clip(r) A grad log pi`` but a loss value equal to
    the clipped surrogate (``-clip(r) A``), comparable with PPO's in the logs. Unlike PPO every token keeps a
    gradient; clipping only bounds its size. MiniMax sets no lower bound: use a large ``clip_low`` (>= 1).
    Metrics: ``clip_frac`` (tokens whose weight was clipped, either side).
    """
    ratio = _ratio(logprobs, old_logprobs)  # [B, A]
    w = ratio.clamp(min=1.0 - clip_low, max=1.0 + clip_high)
    loss = -(w / ratio).detach() * ratio * advantages
    clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return loss, {"clip_frac": masked_mean(clipped.float(), mask)}


@POLICY_LOSSES.register("cpgd")
def cpgd(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, drift_coef: float = 0.0):
    """CPGD (Liu et al. 2025): clipped *log*-ratio policy gradient plus a policy-drift penalty.

    ``loss_t = -min(A log r, A clip(log r, log(1 - clip_low), log(1 + clip_high))) + drift_coef * (r - 1 - log r)``.
    The log-ratio objective has the plain policy-gradient ``A grad log pi`` inside the band (no ratio weighting,
    which is what destabilises PPO-style losses on large updates), and the k3 estimate of ``KL(pi_old || pi)``
    pulls the policy back towards the sampling policy. ``clip_low >= 1`` means no lower bound. The paper's value
    of the drift coefficient is not reproduced here: set ``drift_coef`` explicitly. Metrics: ``clip_frac``,
    ``policy_drift``.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, A]
    low = math.log(1.0 - clip_low) if clip_low < 1.0 else -float("inf")
    clipped_lr = log_ratio.clamp(min=low, max=math.log1p(clip_high))
    surr = -advantages * log_ratio
    surr_clipped = -advantages * clipped_lr
    drift = torch.expm1(log_ratio) - log_ratio  # [B, A] >= 0
    loss = torch.maximum(surr, surr_clipped) + drift_coef * drift
    metrics = {
        "clip_frac": masked_mean((surr_clipped > surr).float(), mask),
        "policy_drift": masked_mean(drift, mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("sapo")
def sapo(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, tau_pos: float = 1.0,
         tau_neg: float = 1.05):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft, temperature-controlled gate in place of PPO's hard clip.

    ``loss_t = -f(r) A`` with ``f(r) = (4 / tau) sigmoid(tau (r - 1))``, ``tau = tau_pos`` where ``A > 0`` and
    ``tau_neg`` otherwise. Its gradient is ``-w(r) r A grad log pi`` (PPO's unclipped one times ``w``) with
    ``w(r) = f'(r) = 4 s (1 - s)``, ``s = sigmoid(tau (r - 1))``: ``w(1) = 1``, so on-policy SAPO is the plain policy
    gradient, and ``w`` decays smoothly as the ratio leaves 1 (a token far off-policy is down-weighted, never cut off
    at a threshold). Why two temperatures: a negative advantage pushes up the logits of every unsampled token, which
    is less stable, so the paper decays those updates faster (``tau_neg > tau_pos``; its 1.05 and 1.0 are the
    defaults).
    ``clip_low`` / ``clip_high`` are accepted and unused (the gate replaces the clip). Metric: ``gate_weight_mean``
    (mean of ``4 s (1 - s)`` over the response tokens: 1 on-policy, smaller the further the update has moved).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo: tau_pos and tau_neg must be > 0; got {tau_pos}, {tau_neg}")
    ratio = _ratio(logprobs, old_logprobs)  # [B, A]
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))  # [B, A]
    gate = torch.sigmoid(tau * (ratio - 1.0))  # [B, A]
    loss = -(4.0 / tau) * gate * advantages
    with torch.no_grad():
        weight = 4.0 * gate * (1.0 - gate)  # [B, A] w(r) = d f / d r
    return loss, {"gate_weight_mean": masked_mean(weight, mask)}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    norm_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's critic loss, ``0.5 * max((V - R)^2, (V_clipped - R)^2)`` with ``V_clipped = V_old + clip(V - V_old,
    -clip, clip)`` (``clip=None``: plain ``0.5 (V - R)^2``).

    Why the max: like the policy clip, a value update may not profit from moving further than ``clip`` from the
    value the advantages were computed with. Metrics: ``vf_loss``, ``vf_clip_frac`` (tokens where the clipped
    term is the larger one: their gradient is 0), ``vf_mean``.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError("values, old_values, returns and mask must have the same shape")
    m = as_bool_mask(mask)
    values = masked_fill_zero(values, m)
    old_values = masked_fill_zero(old_values.detach(), m)
    returns = masked_fill_zero(returns.detach(), m)
    sq = (values - returns) ** 2  # [B, A]
    if clip is None:
        per_token, clipped = 0.5 * sq, torch.zeros_like(m)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        sq_clipped = (v_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(sq, sq_clipped)
        clipped = sq_clipped > sq
    loss = agg_loss(per_token, m, agg, norm_len=norm_len)
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clip_frac": masked_mean(clipped.float(), m).detach(),
        "vf_mean": masked_mean(values.detach(), m),
    }
    return loss, metrics
