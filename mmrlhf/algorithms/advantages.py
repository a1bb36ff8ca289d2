"""Advantage estimators: one registry, one entry point, :func:`compute_advantages`.

An estimator turns per-token rewards ``[B, A]`` (A = response length; outcome rewards usually sit on the last
response token, KL penalties on every token) into per-token advantages and returns, both ``[B, A]`` and exactly 0
outside the mask. Group estimators (``grpo``, ``dr_grpo``, ``rloo``, ``cpgd``) first collapse each response to
its sequence reward (the masked sum of its token rewards) and compare it with the other samples of the same
prompt (same ``group_ids`` entry); ``reinforce_baseline`` uses the group mean only as a baseline before its
batch whitening.

Edge cases, defined once for those four group estimators:

- a group of size 1 has no peer to compare with: its advantage is 0 (no signal, rather than the raw reward,
  which would reintroduce the baseline-free variance the group estimators exist to remove);
- a zero-variance group (all samples scored the same, e.g. all correct) has advantage exactly 0 (detected by
  max == min, not by a tiny std, so rounding noise is never divided by ``eps``);
- a response with no token in the mask has advantage 0 everywhere; its sequence reward (0) still counts in the
  group's statistics, as the sample exists.

A user estimator is any callable ``fn(token_rewards, mask, *, values=None, group_ids=None, **params) ->
(advantages, returns)``, registered with ``@ADVANTAGE_ESTIMATORS.register("name")`` or named in config as
``package.module:function``.

Batch-wide statistics (the whitening of ``reinforce`` / ``reinforce_baseline``, the counts of ``cpgd``'s
``clip_filter``) are taken over the whole STEP, which several training ranks hold in shares: such an estimator takes
a ``step_sum`` keyword, a function that turns this share's float64 sums into the step's (the sum over ranks; None:
this batch is the step). Group statistics need none: a group never straddles ranks. A user estimator with batch-wide
statistics takes ``step_sum`` the same way, or its statistics are its rank's share's.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import Tensor

from mmrlhf.algorithms.checks import check_params
from mmrlhf.algorithms.groups import group_stats
from mmrlhf.algorithms.masked import as_bool_mask, masked_fill_zero, masked_sum
from mmrlhf.algorithms.shaping import masked_moments, normalize_with_moments
from mmrlhf.registry import Registry

Estimator = Callable[..., tuple[Tensor, Tensor]]
StepSum = Callable[[Tensor], Tensor]  # float64 sums of this share -> the same sums over the whole step
ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def compute_advantages(
    name: str,
    token_rewards: Tensor,
    mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    step_sum: StepSum | None = None,
    **params,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns ``[B, A]`` from the estimator registered as ``name`` (or ``module:function``).

    Runs without autograd (advantages are targets, never differentiated through) and forces the result to 0
    outside the mask, whatever a user estimator did there. ``step_sum``: see the module docstring; handed to the
    estimators that take it.
    """
    if token_rewards.dim() != 2 or token_rewards.shape != mask.shape:
        raise ValueError(
            f"token_rewards and mask must both be [B, A]; got {tuple(token_rewards.shape)} and {tuple(mask.shape)}"
        )
    if values is not None and values.shape != token_rewards.shape:
        raise ValueError(f"values must be [B, A] like token_rewards; got {tuple(values.shape)}")
    if group_ids is not None and tuple(group_ids.shape) != (token_rewards.shape[0],):
        raise ValueError(f"group_ids must be [B] = [{token_rewards.shape[0]}]; got {tuple(group_ids.shape)}")
    fn = ADVANTAGE_ESTIMATORS.get(name)
    check_params(fn, params, f"advantage estimator {name!r}")
    m = as_bool_mask(mask)
    if "step_sum" in inspect.signature(fn).parameters:
        params = {**params, "step_sum": step_sum}
    with torch.no_grad():
        adv, ret = fn(token_rewards, m, values=values, group_ids=group_ids, **params)
    return masked_fill_zero(adv, m), masked_fill_zero(ret, m)


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _need(x: Tensor | None, what: str, name: str) -> Tensor:
    if x is None:
        raise ValueError(f"advantage estimator {name!r} needs {what}")
    return x


def sequence_rewards(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Masked sum over the response: ``[B, A] -> [B]``."""
    return masked_sum(token_rewards, mask, dim=-1)


def _broadcast(seq_adv: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B]`` sequence advantages -> ``[B, A]`` on the response tokens."""
    return masked_fill_zero(seq_adv.to(dtype).unsqueeze(-1).expand(mask.shape), mask)


def whiten_over_step(x: Tensor, mask: Tensor, step_sum: StepSum | None, eps: float) -> Tensor:
    """``x`` whitened over the masked entries of the whole step (zeros where they do not vary)."""
    moments = masked_moments(x, mask)
    return normalize_with_moments(x, mask, moments if step_sum is None else step_sum(moments), eps=eps)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_next`` over response tokens, ``[B, A]``.

    "Next" is the next *response* token: masked positions (padding, or tool output inside a multi-turn response)
    are skipped without discounting, so they contribute nothing. A reverse scan over time, vectorised over B.
    """
    mask = as_bool_mask(mask)
    r = masked_fill_zero(token_rewards, mask)
    running = r.new_zeros(r.shape[0])  # [B]
    out = []
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        out.append(running)
    return masked_fill_zero(torch.stack(out[::-1], dim=1), mask) if out else r.clone()


# ----------------------------------------------------------------------------------------------------------------
# estimators


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(token_rewards, mask, *, values=None, group_ids=None, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation (Schulman et al. 2016), the PPO default.

    Reverse scan: ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, where "next"
    is the next response token (masked positions are skipped, contributing nothing; after the last response token
    ``V_next = A_next = 0``: the episode ends). For right-padded responses this is exactly the OpenRLHF /
    ColossalChat recurrence. Returns = advantages + values (the critic's regression target).
    """
    mask = as_bool_mask(mask)
    v = masked_fill_zero(_need(values, "values (a critic)", "gae"), mask)  # [B, A]
    r = masked_fill_zero(token_rewards, mask)  # [B, A]
    next_value = r.new_zeros(r.shape[0])  # [B]
    last = r.new_zeros(r.shape[0])  # [B]
    out = []
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        last = torch.where(m, delta + gamma * lam * last, last)
        next_value = torch.where(m, v[:, t], next_value)
        out.append(last)
    adv = torch.stack(out[::-1], dim=1) if out else r.clone()
    adv = masked_fill_zero(adv, mask)
    return adv, masked_fill_zero(adv + v, mask)


def _group_normalised(token_rewards, mask, group_ids, name, *, eps, norm_by_std, unbiased=True):
    rewards = sequence_rewards(token_rewards, mask)  # [B]
    st = group_stats(rewards, _need(group_ids, "group_ids", name))
    centred = rewards.to(torch.float64) - st.mean  # [B]
    if norm_by_std:
        centred = centred / ((st.std if unbiased else st.pop_std) + eps)
    centred = torch.where(st.constant, torch.zeros_like(centred), centred)  # size-1 and zero-variance groups
    adv = _broadcast(centred, mask, token_rewards.dtype)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("grpo", aliases=("group_norm",))
def grpo(token_rewards, mask, *, values=None, group_ids=None, eps: float = 1e-6, norm_by_std: bool = True):
    """GRPO (Shao et al. 2024): ``(R_i - mean_g) / (std_g + eps)``, ``R_i`` the sequence reward, std unbiased.

    Broadcast to every response token; returns = advantages (there is no critic).
    """
    return _group_normalised(token_rewards, mask, group_ids, "grpo", eps=eps, norm_by_std=norm_by_std)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(token_rewards, mask, *, values=None, group_ids=None):
    """Dr. GRPO (Liu et al. 2025): ``R_i - mean_g``; no std division, which biases towards easy/hard prompts."""
    return _group_normalised(token_rewards, mask, group_ids, "dr_grpo", eps=0.0, norm_by_std=False)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(token_rewards, mask, *, values=None, group_ids=None):
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): ``R_i - mean of the other n-1 samples of the group``.

    Computed as ``(n R_i - S_g) / (n - 1)`` (S_g the group sum), which equals the leave-one-out form.
    """
    rewards = sequence_rewards(token_rewards, mask)  # [B]
    st = group_stats(rewards, _need(group_ids, "group_ids", "rloo"))
    r = rewards.to(torch.float64)
    loo = (st.count * r - st.sum) / (st.count - 1).clamp(min=1)  # [B]
    loo = torch.where(st.constant, torch.zeros_like(loo), loo)
    adv = _broadcast(loo, mask, token_rewards.dtype)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("reinforce", aliases=("reinforce++",))
def reinforce(token_rewards, mask, *, values=None, group_ids=None, gamma: float = 1.0, eps: float = 1e-8,
              step_sum: StepSum | None = None):
    """REINFORCE++ (Hu 2025): discounted reward-to-go per token, whitened over all response tokens of the batch.

    Returns = the un-whitened reward-to-go. The whitening is global (batch-level), not per group: that is the
    point of REINFORCE++ (no per-prompt normalisation). A batch whose reward-to-go is constant gets zeros.
    """
    returns = discounted_returns(token_rewards, mask, gamma)  # [B, A]
    return whiten_over_step(returns, mask, step_sum, eps), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline")
def reinforce_baseline(token_rewards, mask, *, values=None, group_ids=None, gamma: float = 1.0, eps: float = 1e-8,
                       step_sum: StepSum | None = None):
    """REINFORCE++-baseline: reward-to-go minus the group mean of the sequence returns, then batch whitening.

    ``A_t = G_t - mean_g(G_0)``, with ``G_0`` the full (discounted) sequence return. With outcome rewards only
    and ``gamma = 1`` every ``G_t = R_i`` and this is ``R_i - mean_g(R)`` on every token, as in OpenRLHF. A group of
    size 1 is its own baseline (the outcome part cancels).
    """
    returns = discounted_returns(token_rewards, mask, gamma)  # [B, A]
    mask = as_bool_mask(mask)
    if returns.shape[1]:
        first = mask.to(torch.int64).argmax(dim=-1)  # [B] first response token (0 for an empty row: G is 0 there)
        g0 = returns.gather(1, first.unsqueeze(-1)).squeeze(-1)  # [B]
    else:
        g0 = returns.new_zeros(returns.shape[0])  # [B]
    st = group_stats(g0, _need(group_ids, "group_ids", "reinforce_baseline"))
    centred = returns - st.mean.to(returns.dtype).unsqueeze(-1)  # [B, A]
    return whiten_over_step(centred, mask, step_sum, eps), returns


@ADVANTAGE_ESTIMATORS.register("cpgd")
def cpgd(
    token_rewards,
    mask,
    *,
    values=None,
    group_ids=None,
    weight: str = "std",
    eps: float = 1e-6,
    max_weight: float = 3.0,
    step_sum: StepSum | None = None,
):
    """CPGD (Liu et al. 2025, arXiv 2505.12504; released with MM-Eureka): group-relative sequence advantage.

    ``weight="std"``: ``(R_i - mean_g) / (pop_std_g + eps)`` -- like GRPO but with the population (biased) std,
    as CPGD's reference code uses. ``weight="clip_filter"``: ``(R_i - mean_g) * min(N / N_valid, max_weight)``,
    ``N`` the samples with a response token (samples masked out by the reward engine have none and are not
    counted) and ``N_valid`` the samples in groups with non-zero variance: instead of re-sampling
    (DAPO's filter), the informative groups are up-weighted so the batch keeps its effective step size; the cap
    bounds the up-weighting when almost every group is degenerate. CPGD's stability comes from its loss (clipped
    log-ratio plus a policy-drift KL, see ``losses.cpgd``), not from this estimator.
    """
    if weight not in ("std", "clip_filter"):
        raise ValueError(f"cpgd weight must be 'std' or 'clip_filter', got {weight!r}")
    if weight == "std":
        return _group_normalised(token_rewards, mask, group_ids, "cpgd", eps=eps, norm_by_std=True, unbiased=False)
    rewards = sequence_rewards(token_rewards, mask)  # [B]
    st = group_stats(rewards, _need(group_ids, "group_ids", "cpgd"))
    present = as_bool_mask(mask).any(-1)  # [B] rows with a response token (masked-out samples have none)
    counts = torch.stack([present.sum(), (~st.constant & present).sum()]).to(torch.float64)  # [N, N_valid]
    n_present, n_valid = (step_sum(counts) if step_sum is not None else counts).tolist()
    scale = min(n_present / n_valid, max_weight) if n_valid else 0.0
    centred = (rewards.to(torch.float64) - st.mean) * scale
    centred = torch.where(st.constant, torch.zeros_like(centred), centred)
    adv = _broadcast(centred, mask, token_rewards.dtype)
    return adv, adv.clone()
