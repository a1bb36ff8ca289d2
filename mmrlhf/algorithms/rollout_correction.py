"""Rollout correction: importance sampling between the engine that sampled and the policy the trainer scores.

Why: the rollout engine (vLLM, often bf16, its own kernels) and the trainer (fp32 or bf16, transformers kernels)
compute slightly different distributions for the same weights, and with asynchronous training the engine may even
hold older weights. The samples come from the engine's distribution ``mu``; the PPO ratio is taken against the
trainer's ``pi_old``. Weighting each token by ``pi_old / mu`` makes the gradient an unbiased estimate for
``pi_old`` again; capping that weight keeps its variance bounded (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training": truncated IS, TIS). Masking instead of capping (MIS) drops the tokens
or whole responses whose ratio is implausible, where a mismatch is a sign of a broken sample rather than noise.

``rollout_logprobs`` must be the engine's log-probs of the distribution it actually sampled from (after
temperature; see docs/algorithms.md for how top-p / top-k truncation enters), ``old_logprobs`` the trainer's at
the same temperature. All tensors are ``[B, A]``; nothing here has gradients (weights are constants in the loss).

Levels: ``token`` uses each token's ratio; ``sequence`` uses the response's product of ratios (the exact IS weight
of a whole response; it grows with length, so caps must be looser); ``geometric`` uses the geometric mean of the
token ratios (a per-response, length-normalised ratio: robust for long answers).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mmrlhf.algorithms.kl import LOG_RATIO_CLAMP
from mmrlhf.algorithms.masked import as_bool_mask, masked_fill_zero, masked_mean

Mode = Literal["none", "tis", "mis"]
Level = Literal["token", "sequence", "geometric"]
MODES: tuple[str, ...] = ("none", "tis", "mis")
LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")


def importance_ratios(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """``pi_old / mu`` per token ``[B, A]`` (``sequence`` / ``geometric``: the response's ratio broadcast to its
    tokens); exactly 1 outside the mask. Log-ratios are clamped to ``[-20, 20]`` before ``exp``."""
    if level not in LEVELS:
        raise ValueError(f"unknown rollout-correction level {level!r}; valid: {', '.join(LEVELS)}")
    m = as_bool_mask(mask)
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)  # float32 (float64 inputs stay float64)
    log_ratio = masked_fill_zero(old_logprobs.to(dtype) - rollout_logprobs.to(dtype), m)  # [B, A]
    if level == "token":
        per = log_ratio
    else:
        seq = log_ratio.sum(-1, keepdim=True)  # [B, 1]
        if level == "geometric":
            seq = seq / m.sum(-1, keepdim=True).clamp(min=1)
        per = seq.expand_as(log_ratio)
    ratio = per.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B, A]
    return torch.where(m, ratio, torch.ones_like(ratio))


@torch.no_grad()
def rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    lower: float = 0.0,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token importance weights ``[B, A]``, the loss mask after correction ``[B, A]`` and metrics.

    - ``none``: weights 1, mask unchanged (metrics are still reported: they measure the engine/trainer gap);
    - ``tis``: weight ``min(ratio, cap)``; no token leaves the loss;
    - ``mis``: weight ``ratio``; tokens (token level) or whole responses (sequence levels) whose ratio is above
      ``cap`` or below ``lower`` leave the loss.

    Metrics (``rollout_is/*``) describe the RAW ratios before truncation or masking, over masked positions:
    ``ratio_min`` / ``ratio_mean`` / ``ratio_max``, ``truncated_frac`` (tis) or ``masked_frac`` (mis, the share of
    response tokens removed), and ``abs_log_ratio_mean`` (the mean per-token |log pi_old - log mu|, the
    engine/trainer mismatch itself).
    """
    if mode not in MODES:
        raise ValueError(f"unknown rollout-correction mode {mode!r}; valid: {', '.join(MODES)}")
    if not cap > 0 or not 0 <= lower < cap:
        raise ValueError(f"rollout correction needs cap > 0 and 0 <= lower < cap; got cap={cap}, lower={lower}")
    if not old_logprobs.shape == rollout_logprobs.shape == mask.shape:
        raise ValueError(f"old_logprobs, rollout_logprobs and mask must all be [B, A]; got "
                         f"{tuple(old_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}")
    m = as_bool_mask(mask)
    ratio = importance_ratios(old_logprobs, rollout_logprobs, m, level)  # [B, A]
    metrics = _ratio_metrics(ratio, old_logprobs, rollout_logprobs, m)
    if mode == "none":
        return torch.ones_like(ratio), m.clone(), metrics
    if mode == "tis":
        truncated = m & (ratio > cap)
        metrics["rollout_is/truncated_frac"] = masked_mean(truncated.float(), m)
        return torch.where(m, ratio.clamp(max=cap), torch.ones_like(ratio)), m.clone(), metrics
    outside = m & ((ratio > cap) | (ratio < lower))  # sequence levels: the same for every token of a response
    keep = m & ~outside
    metrics["rollout_is/masked_frac"] = masked_mean(outside.float(), m)
    return torch.where(keep, ratio, torch.ones_like(ratio)), keep, metrics


def _ratio_metrics(ratio: Tensor, old: Tensor, rollout: Tensor, m: Tensor) -> dict[str, Tensor]:
    if not m.any():
        zero = ratio.new_zeros(())
        return {"rollout_is/ratio_min": zero + 1, "rollout_is/ratio_mean": zero + 1, "rollout_is/ratio_max": zero + 1,
                "rollout_is/abs_log_ratio_mean": zero}
    values = ratio[m]
    return {
        "rollout_is/ratio_min": values.min(),
        "rollout_is/ratio_mean": values.mean(),
        "rollout_is/ratio_max": values.max(),
        "rollout_is/abs_log_ratio_mean": masked_mean((old - rollout).abs().to(ratio.dtype), m),
    }
