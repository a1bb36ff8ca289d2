"""RL algorithms as pure tensor functions: advantage estimators, KL, reward shaping, dynamic sampling, losses.

No I/O, no distributed code, no config objects: the trainer maps the ``algorithm`` config section to the
arguments of these functions. Names resolve through two registries, ``ADVANTAGE_ESTIMATORS`` and
``POLICY_LOSSES`` (the only dispatch path; users add their own with ``.register`` or ``module:function``).
See docs/algorithms.md.
"""

from mmrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from mmrlhf.algorithms.distill import mix_advantages, reverse_kl_advantages
from mmrlhf.algorithms.dynamic_sampling import FillResult, SampledGroups, fill_batch, filter_groups
from mmrlhf.algorithms.entropy import entropy_from_logits, high_entropy_mask
from mmrlhf.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    approx_kl,
    kl_controller,
    kl_loss,
    kl_penalized_rewards,
)
from mmrlhf.algorithms.losses import POLICY_LOSSES, policy_loss, value_loss
from mmrlhf.algorithms.masked import agg_loss, masked_mean
from mmrlhf.algorithms.reward_components import per_component_rewards
from mmrlhf.algorithms.shaping import (
    RunningRewardNorm,
    clip_advantages,
    clip_rewards,
    cross_batch_normalize,
    overlong_penalty,
    token_level_rewards,
    whiten_advantages,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FillResult",
    "FixedKLController",
    "RunningRewardNorm",
    "SampledGroups",
    "agg_loss",
    "approx_kl",
    "clip_advantages",
    "clip_rewards",
    "compute_advantages",
    "cross_batch_normalize",
    "entropy_from_logits",
    "fill_batch",
    "filter_groups",
    "high_entropy_mask",
    "kl_controller",
    "kl_loss",
    "kl_penalized_rewards",
    "masked_mean",
    "mix_advantages",
    "overlong_penalty",
    "per_component_rewards",
    "policy_loss",
    "reverse_kl_advantages",
    "token_level_rewards",
    "value_loss",
    "whiten_advantages",
]
