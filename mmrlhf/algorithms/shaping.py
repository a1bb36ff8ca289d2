"""Reward and advantage shaping: overlong penalty, running normalisation, clipping, whitening.

Each transform returns ``(tensor, metrics)``; metrics are detached 0-d tensors (no host sync here: the trainer
reduces them across ranks and logs them) and always say how much the transform changed, e.g. what fraction it
clipped, so a silently saturating clip shows up in the logs.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from mmrlhf.algorithms.masked import as_bool_mask, masked_fill_zero, masked_mean


def _f(x: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device=like.device).detach()


def token_level_rewards(seq_rewards: Tensor, mask: Tensor) -> Tensor:
    """Place one scalar reward per response ``[B]`` on its last response token, ``[B, A]``.

    The usual hand-off from an outcome reward to the per-token estimators (and to a per-token KL penalty). A row
    with an empty mask has no token to carry its reward: it gets zeros (a response of length 0 has no action).
    """
    m = as_bool_mask(mask)
    a = m.shape[-1]
    out = torch.zeros(m.shape, dtype=seq_rewards.dtype, device=seq_rewards.device)  # [B, A]
    if a == 0:
        return out
    pos = torch.arange(a, device=m.device).expand_as(m)  # [B, A]
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(-1)  # [B], -1 for an empty row
    has = last >= 0  # [B]
    value = torch.where(has, seq_rewards, torch.zeros_like(seq_rewards))  # an empty row writes 0 at position 0
    return out.scatter(1, last.clamp(min=0).unsqueeze(-1), value.unsqueeze(-1))


def overlong_penalty(
    response_lengths: Tensor, max_len: int, buffer_len: int, factor: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO's soft overlong punishment, ``[B]`` (add it to the sequence reward).

    ``0`` for ``L <= max_len - buffer_len``; ``-factor * (L - (max_len - buffer_len)) / buffer_len`` inside the
    buffer (a linear ramp from 0 to ``-factor``); ``-factor`` beyond ``max_len``. Why: a truncated response is
    usually cut mid-reasoning and its outcome reward is noise; the ramp tells the policy "getting long" before it
    is cut off. ``buffer_len = 0`` penalises only ``L > max_len``. Metrics: ``overlong_buffer_frac`` (in the
    ramp), ``overlong_truncated_frac`` (beyond ``max_len``; a response generated with ``max_new_tokens = max_len``
    that was cut off has ``L = max_len`` and sits at the end of the ramp), ``overlong_penalty_mean``.
    """
    if buffer_len < 0 or buffer_len > max_len or factor < 0:
        raise ValueError(f"need 0 <= buffer_len <= max_len and factor >= 0; got {buffer_len}, {max_len}, {factor}")
    length = response_lengths.to(torch.float32)  # [B]
    start = float(max_len - buffer_len)
    if buffer_len > 0:
        ramp = -factor * (length - start) / buffer_len  # [B]
    else:
        ramp = torch.zeros_like(length)
    in_buffer = (length > start) & (length <= max_len)  # [B]
    over = length > max_len  # [B]
    pen = torch.where(over, torch.full_like(length, -factor), torch.where(in_buffer, ramp, torch.zeros_like(length)))
    zero = pen.sum() * 0
    metrics = {
        "overlong_buffer_frac": in_buffer.float().mean() if pen.numel() else zero,
        "overlong_truncated_frac": over.float().mean() if pen.numel() else zero,
        "overlong_penalty_mean": pen.mean() if pen.numel() else zero,
    }
    return pen, {k: v.detach() for k, v in metrics.items()}


def clip_values(x: Tensor, clip: float | None, mask: Tensor | None = None, *, prefix: str) -> tuple[Tensor, dict]:
    """Clamp ``x`` to ``[-clip, clip]`` (``None`` = off) and report ``{prefix}_clip_frac`` over the mask."""
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else as_bool_mask(mask)
    if clip is None:
        return x, {f"{prefix}_clip_frac": _f(0.0, x)}
    if clip <= 0:
        raise ValueError(f"{prefix} clip must be > 0, got {clip}")
    clipped = (x.abs() > clip) & m
    out = x.clamp(-clip, clip)
    out = out if mask is None else masked_fill_zero(out, m)
    return out, {f"{prefix}_clip_frac": masked_mean(clipped.float(), m).detach()}


def clip_rewards(rewards: Tensor, clip: float | None, mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Reward clipping to ``[-clip, clip]``: caps a reward model's outliers. Metric ``reward_clip_frac``."""
    return clip_values(rewards, clip, mask, prefix="reward")


def clip_advantages(advantages: Tensor, mask: Tensor, clip: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantage clipping to ``[-clip, clip]`` on response tokens. Metric ``advantage_clip_frac``."""
    return clip_values(advantages, clip, mask, prefix="advantage")


def whiten_advantages(
    advantages: Tensor, mask: Tensor, *, moments: Tensor | None = None, shift_mean: bool = True, eps: float = 1e-8
) -> tuple[Tensor, dict[str, Tensor]]:
    """Batch whitening over response tokens: ``(x - mean) / sqrt(var + eps)``, zeros where the variance is zero.

    ``moments``: the step's ``[count, sum, sum of squares]`` (:func:`masked_moments` summed over the parts of the
    step, e.g. over the training ranks); None takes this batch's own. Metrics: the statistics before whitening,
    ``advantage_mean`` / ``advantage_std`` (population), of the same moments.
    """
    m = as_bool_mask(mask)
    moments = masked_moments(advantages, m) if moments is None else moments
    mean, std = moment_stats(moments)
    out = normalize_with_moments(advantages, m, moments, shift_mean=shift_mean, eps=eps)
    return out, {"advantage_mean": _f(mean, advantages), "advantage_std": _f(std, advantages)}


# ----------------------------------------------------------------------------------------------------------------
# cross-batch normalisation


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """``[count, sum, sum of squares]`` (float64) of the masked entries: the sufficient statistics to combine.

    Summing these over micro-batches (or all-reducing them over ranks, in the trainer) and passing the total to
    :func:`normalize_with_moments` normalises every part with the statistics of the whole batch.
    """
    m = as_bool_mask(mask)
    v = masked_fill_zero(x, m).to(torch.float64)
    return torch.stack([m.sum().to(torch.float64), v.sum(), (v * v).sum()])


def moment_stats(moments: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, population std) of ``[count, sum, sum of squares]`` (0-d float64 tensors, no host sync); 0 for no
    entries."""
    count, total, sq = moments.unbind()
    n = count.clamp(min=1)
    mean = total / n
    return mean, (sq / n - mean * mean).clamp(min=0).sqrt()


def normalize_with_moments(
    x: Tensor, mask: Tensor, moments: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (population) variance taken from ``moments``.

    Zero pooled variance (or no tokens) gives zeros, as batch whitening does.
    """
    count, total, sq = moments.unbind()
    n = count.clamp(min=1)
    mean = total / n
    var = (sq / n - mean * mean).clamp(min=0)
    # E[x^2] - E[x]^2 cancels catastrophically; treat variance below the float64 rounding of E[x^2] as zero
    tiny = (sq / n).abs() * 1e-12
    centred = x.to(torch.float64) - (mean if shift_mean else 0.0)
    flat = torch.zeros_like(centred) if shift_mean else centred
    out = torch.where(var > tiny, centred * torch.rsqrt(var + eps), flat)
    return masked_fill_zero(out.to(x.dtype), mask)


def cross_batch_normalize(
    advantages: Sequence[Tensor], masks: Sequence[Tensor], *, shift_mean: bool = True, eps: float = 1e-8
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Whiten several advantage tensors (micro-batches of one step, possibly of different shapes) with their pooled
    statistics, so each micro-batch is not normalised against itself alone: small micro-batches would otherwise
    each get mean 0 / std 1 and the relative scale between them would be lost.

    Metrics: pooled ``advantage_mean`` / ``advantage_std`` before normalisation, ``advantage_tokens``.
    """
    if len(advantages) != len(masks):
        raise ValueError(f"{len(advantages)} advantage tensors but {len(masks)} masks")
    if not advantages:
        return [], {}
    total = sum(masked_moments(a, m) for a, m in zip(advantages, masks))
    mean, std = moment_stats(total)
    out = [normalize_with_moments(a, m, total, shift_mean=shift_mean, eps=eps) for a, m in zip(advantages, masks)]
    like = advantages[0]
    return out, {"advantage_mean": _f(mean, like), "advantage_std": _f(std, like),
                 "advantage_tokens": _f(total[0], like)}


# ----------------------------------------------------------------------------------------------------------------
# running reward normalisation


class RunningRewardNorm:
    """Normalise rewards by running statistics over every reward seen so far (Chan et al.'s parallel update).

    Why running rather than per-batch: a per-batch z-score erases the signal when a whole batch improves; the
    running statistics keep "better than usual" meaningful. ``center=False`` only divides by the running std (the
    sign of a reward is kept, which matters for rule-based 0/1 rewards). Until two rewards have been seen, or while
    the running std is below ``eps``, the scale is 1 (no division by ~0). ``state_dict`` holds plain floats so
    the trainer can checkpoint it.
    """

    def __init__(self, *, center: bool = True, eps: float = 1e-6) -> None:
        self.center = center
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def update(self, rewards: Tensor) -> None:
        """Fold in a batch of rewards (every reward of the step: the trainer passes the step's statistics to
        :meth:`update_with` instead when the step is split over ranks)."""
        x = rewards.detach().to(torch.float64).flatten()
        n = int(x.numel())
        if n == 0:
            return
        b_mean = float(x.mean())
        self.update_with(n, b_mean, float(((x - b_mean) ** 2).sum()))

    def update_with(self, n: int, b_mean: float, b_m2: float) -> None:
        """Fold in a batch given by its size, mean and sum of squared deviations from that mean."""
        if n <= 0:
            return
        tot = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / tot
        self.m2 += b_m2 + delta * delta * self.count * n / tot
        self.count = tot

    def __call__(self, rewards: Tensor, *, update: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
        """Update with ``rewards`` (first, so the very first batch is normalised by its own statistics), then
        normalise. Metrics: ``reward_running_mean`` / ``reward_running_std``."""
        if update:
            self.update(rewards)
        std = self.std
        scale = std if std > self.eps else 1.0
        shift = self.mean if self.center else 0.0
        out = (rewards - shift) / scale
        return out, {"reward_running_mean": _f(self.mean, rewards), "reward_running_std": _f(std, rewards)}

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
