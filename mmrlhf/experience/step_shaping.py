"""Sequence rewards -> per-token advantages over a whole step: the recipe's terms combined (summed, or z-scored per
group first), overlong penalty, running reward normalisation, reward clipping, the KL penalty and its controller,
the advantage estimator, advantage whitening and clipping.

Why a module of its own: several of these read statistics of the WHOLE step (the running reward statistics, the KL
the adaptive controller tracks, the whitening moments, the batch-wide statistics of some estimators), and with
several training ranks each rank holds only its share of the step. Every such statistic is summed over the ranks
(``world.all_sum``, float64) and handed to the pure math of :mod:`mmrlhf.algorithms` already reduced, so each rank
shapes its share exactly as one process shapes the whole step, and the running state (reward statistics, KL
coefficient) stays the same on every rank. A world of one rank sums nothing. Every rank calls :func:`shape_step`
once per step, whatever it holds: the collectives pair across ranks.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from mmrlhf.algorithms.advantages import compute_advantages
from mmrlhf.algorithms.distill import distill_metrics, mix_advantages, reverse_kl_advantages
from mmrlhf.algorithms.groups import isolate_invalid
from mmrlhf.algorithms.kl import approx_kl, kl_penalized_rewards
from mmrlhf.algorithms.reward_components import per_component_rewards
from mmrlhf.algorithms.shaping import (
    RunningRewardNorm,
    clip_advantages,
    clip_rewards,
    masked_moments,
    overlong_penalty,
    token_level_rewards,
    whiten_advantages,
)
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.parallel.world import World
from mmrlhf.rewards.types import RewardResult


def step_sum(world: World) -> Callable[[Tensor], Tensor]:
    """A float64 tensor of this rank's sums -> the same sums over every rank (collective)."""

    def total(t: Tensor) -> Tensor:
        return torch.tensor(world.all_sum(t.tolist()), dtype=torch.float64, device=t.device)

    return total


def combined_rewards(rewards: RewardResult, groups: Tensor, *, combination: str = "sum", eps: float = 1e-6,
                     extra: dict[str, tuple[Tensor, float]] | None = None) -> Tensor:
    """``[N]`` float32 rewards the step trains on, from the reward engine's answer and the ``[N]`` group ids
    (``algorithm.reward_combination``): ``sum``, the engine's weighted sum of raw scores; ``per_component``, the
    weighted sum of each recipe term's z-score within its group (:mod:`mmrlhf.algorithms.reward_components`), over
    the valid samples only (a masked one is alone in its group and gets 0). Group-local, so a rank's share, or a
    round of dynamic sampling, gives each sample what the whole step gives it: groups never straddle either.

    ``extra``: terms the trainer adds to the recipe's (the overlong penalty, the agent's tool bonus), name -> (``[N]``
    values, weight). ``sum`` adds the values as they are; ``per_component`` makes each one more component, z-scored
    in its group like the recipe's terms and weighted by its own size (the penalty's factor, the bonus), so it
    counts beside the recipe's unit-spread terms as the recipe's weights say, not by its raw scale.

    Why a function apart: dynamic sampling's group filter and the shaping must rank samples by the same reward, and
    evaluation keeps reporting the raw one (``RewardResult.rewards`` is never overwritten)."""
    extra = extra or {}
    if combination == "sum":
        out = rewards.rewards.float()
        for values, _ in extra.values():
            out = out + values.to(out)
        return out
    if combination != "per_component":
        raise ValueError(f"reward combination must be 'sum' or 'per_component', got {combination!r}")
    names = sorted(rewards.sources)
    if not rewards.weights or not names:
        raise ValueError("algorithm.reward_combination=per_component needs each sample's recipe weights "
                         "(RewardResult.weights, filled by the RewardComputationEngine)")
    columns = [rewards.sources[k] for k in names]
    weighs = [rewards.weights.get(k, torch.zeros_like(rewards.sources[k])) for k in names]
    for values, weight in extra.values():
        columns.append(values.to(columns[0]))
        weighs.append(torch.full_like(columns[0], float(weight)))
    scores = torch.stack(columns, dim=1)  # [N, C + extra]
    weights = torch.stack(weighs, dim=1)  # [N, C + extra]
    valid = rewards.valid
    group_ids = isolate_invalid(torch.as_tensor(groups, dtype=torch.long), valid)  # [N]
    out = per_component_rewards(scores, weights, group_ids, eps=eps).float()  # [N]
    return torch.where(valid, out, torch.zeros_like(out))


def shape_step(s: ExperienceSettings, *, groups: list[int], rewards: RewardResult, lengths: Tensor,
               max_new_tokens: int, mask: Tensor, log_probs: Tensor, ref_log_probs: Tensor | None,
               values: Tensor | None, reward_norm: RunningRewardNorm | None, kl_controller: Any,
               world: World, bonus: Tensor | None = None,
               teacher_log_probs: Tensor | None = None) -> dict[str, Any]:
    """This rank's share of the step (``[N]`` groups, rewards and response lengths, ``[N, A]`` action mask and
    scores) -> ``[N, A]`` advantages, returns, trained mask and KL, ``[N]`` shaped rewards, validity and groups, and
    metrics. ``reward_norm`` and ``kl_controller`` are updated from the whole step's rewards and KL. ``bonus``
    (``[N]``, e.g. ``agent.tool_bonus``) joins the recipe's terms with the overlong penalty (:func:`combined_rewards`:
    added under ``sum``, one more z-scored component each under ``per_component``).
    ``teacher_log_probs`` ``[N, A]`` (``settings.distill_coef > 0``): the teacher's scores of the sampled tokens; the
    distillation advantage they give is added to the estimator's, before whitening and clipping (per token, so no
    step-wide statistic: each rank adds its own share's; the ``distill/*`` metrics are this rank's)."""
    total = step_sum(world)
    valid = rewards.valid.clone()  # [N]
    metrics: dict[str, float] = {}
    extra: dict[str, tuple[Tensor, float]] = {}
    if s.overlong_buffer_len > 0:
        pen, m = overlong_penalty(lengths, max_new_tokens, s.overlong_buffer_len, s.overlong_penalty_factor)
        extra["overlong_penalty"] = (pen, s.overlong_penalty_factor)
        metrics.update({k: float(v) for k, v in m.items()})
    if bonus is not None:  # every paid trajectory gets the same bonus: its size is the largest
        extra["tool_bonus"] = (bonus, float(bonus.abs().max()) if bonus.numel() else 0.0)
    seq_reward = combined_rewards(rewards, torch.tensor(groups, dtype=torch.long), combination=s.reward_combination,
                                  eps=s.reward_component_eps, extra=extra).clone()  # [N]
    if reward_norm is not None:
        seq_reward, m = _normalise_rewards(reward_norm, seq_reward, valid, world)
        metrics.update(m)
    seq_reward, m = clip_rewards(seq_reward, s.reward_clip)
    metrics.update({k: float(v) for k, v in m.items()})
    # A sample masked out by the reward engine leaves the loss: empty mask, and a group of its own.
    mask = mask.bool() & valid[:, None]
    group_ids = isolate_invalid(torch.tensor(groups, dtype=torch.long), valid)
    token_rewards = token_level_rewards(seq_reward, mask)  # [N, A]
    kl = None
    if s.need_reference or s.kl_in_reward:
        kl = approx_kl(log_probs, ref_log_probs, mask, s.kl_estimator)  # [N, A]
    if s.kl_in_reward:
        token_rewards, m = kl_penalized_rewards(token_rewards, log_probs, ref_log_probs, mask, kl_controller.value,
                                                estimator=s.kl_estimator)
        metrics.update({k: float(v) for k, v in m.items()})
        metrics["kl_seq"] = _update_kl_controller(kl_controller, kl, mask, valid, world)
    adv, ret = compute_advantages(s.advantage_estimator, token_rewards, mask, values=values, group_ids=group_ids,
                                  step_sum=total, **dict(s.advantage_params))
    if s.distill_coef > 0:
        if teacher_log_probs is None:
            raise ValueError("settings.distill_coef > 0 but no teacher log-probs were given (build the maker with "
                             "teacher_model=...)")
        adv = mix_advantages(adv, reverse_kl_advantages(log_probs, teacher_log_probs, mask, coef=s.distill_coef),
                             mask)
        metrics.update(distill_metrics(log_probs, teacher_log_probs, mask))
    if s.advantage_whitening:
        adv, m = whiten_advantages(adv, mask, moments=total(masked_moments(adv, mask)))
        metrics.update({k: float(v) for k, v in m.items()})
    adv, m = clip_advantages(adv, mask, s.advantage_clip)
    metrics.update({k: float(v) for k, v in m.items()})
    return {"advantages": adv, "returns": ret, "mask": mask, "kl": kl, "seq_reward": seq_reward,
            "valid": valid, "groups": group_ids, "metrics": metrics}


def _normalise_rewards(norm: RunningRewardNorm, seq_reward: Tensor, valid: Tensor,
                       world: World) -> tuple[Tensor, dict[str, float]]:
    """Fold the step's valid rewards (every rank's) into the running statistics, then normalise this rank's with
    them. Two passes over the step, as one process takes them: the mean first, then the squared deviations from it."""
    x = seq_reward[valid].to(torch.float64)  # [n_valid]
    n, s = world.all_sum([float(x.numel()), float(x.sum())])
    if n == 0:
        return seq_reward, {}
    mean = s / n
    (m2,) = world.all_sum([float(((x - mean) ** 2).sum())])
    norm.update_with(int(n), mean, m2)
    normed, m = norm(seq_reward[valid], update=False)
    return seq_reward.masked_scatter(valid, normed), {k: float(v) for k, v in m.items()}


def _update_kl_controller(controller: Any, kl: Tensor, mask: Tensor, valid: Tensor, world: World) -> float:
    """Step the controller with the step's mean per-response KL (responses with a token; a masked-out sample carries
    none and must not pull the mean towards 0) over the step's valid samples; returns that mean."""
    rows = mask.any(-1)  # [N]
    seq_sum = float(kl.sum(-1)[rows].to(torch.float64).sum())
    seq_sum, n_rows, n_valid = world.all_sum([seq_sum, float(rows.sum()), float(valid.sum())])
    seq_kl = seq_sum / n_rows if n_rows else 0.0
    controller.update(seq_kl, int(n_valid))
    return seq_kl
