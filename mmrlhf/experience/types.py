"""``Experience``: what one policy / critic update consumes, derived from a model batch
(:mod:`mmrlhf.models.batch`, same padded or packed layout) by the experience makers.

A plain dataclass with no reference to engines or models: an ``Experience`` can be shipped to a trainer in another
process. ``to_device`` / ``pin_memory`` walk every field, including lists and dicts of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmrlhf.models.batch import TensorContainer, slice_vision


@dataclass
class Experience(TensorContainer):
    """Everything one policy/critic update needs for a micro-batch (batched or packed layout as in ``Samples``)."""

    sequences: torch.Tensor  # [B, S] | [1, T]
    # [B, A] actor log-probs of the sampled tokens (at generation time); None: the trainer scores them (Ray,
    # mmrlhf.models.ray_placement.policy_on_trainers)
    action_log_probs: torch.Tensor | None
    base_action_log_probs: torch.Tensor | None  # [B, A] reference-policy log-probs (None without KL)
    values: torch.Tensor | None  # [B, A] critic values (None without a critic)
    returns: torch.Tensor | None  # [B, A] value targets
    advantages: torch.Tensor | None  # [B, A]
    attention_mask: torch.Tensor | None  # [B, S] | [1, T]
    action_mask: torch.Tensor | None  # [B, A] bool
    info: dict[str, Any] = field(default_factory=dict)  # per-sample [B] tensors and scalars for logging
    kl: torch.Tensor | None = None  # [B, A] per-token KL(actor || reference) estimate
    action_entropy: torch.Tensor | None = None  # [B, A] per-token policy entropy (high-entropy filtering)
    rollout_log_probs: torch.Tensor | None = None  # [B, A] the engine's log-probs of the sampled tokens, on the
    #   distribution it sampled from (rollout correction); None when the engine reported none
    packed_seq_lens: torch.Tensor | None = None  # [B] for the packed layout
    num_actions: int | torch.Tensor | None = None  # A | [B] packed
    rollout_versions: torch.Tensor | None = None  # [B, A] long rollout.partial: the policy version that sampled each
    #   response token (0 off the mask); None: the whole rollout came from one version
    policy_mask: torch.Tensor | None = None  # [B, A] bool multi-turn samples: policy tokens (observation tokens
    #   False); None: every response token is the policy's. ``action_mask`` is always within it.
    # [B, A, k] the distillation teacher's k most likely tokens at each response position: their log-probs (float32)
    # and ids (int32), 0 off the mask (algorithm.distill_loss_coef; mmrlhf.algorithms.distill_topk); None without
    teacher_topk_log_probs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None


@dataclass
class ExperienceVL(Experience):
    """Experience of a vision-language model: the vision inputs ride along so training re-runs the exact forward."""

    pixel_values: torch.Tensor | None = None  # [sum of image patch rows, D]
    image_grid_thws: torch.Tensor | None = None  # [total images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [sum of video patch rows, D]
    video_grid_thws: torch.Tensor | None = None  # [total videos, 3]
    mm_token_type_ids: torch.Tensor | None = None  # same shape as sequences
    image_num: list[int] = field(default_factory=list)  # B
    video_num: list[int] = field(default_factory=list)  # B
    raw_images: list[list[Any]] | None = None  # B lists of PIL images (reports only; not moved to devices)
    vision_extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per-video extras, e.g. second_per_grid_ts
    routed_experts: torch.Tensor | None = None  # [B, S, L, k] | [1, T, L, k] int16 the engine's expert choice per
    #   token (rollout.routing_replay; SamplesVL.routed_experts); None: not recorded

    def vision_inputs(self, index: int) -> dict[str, torch.Tensor]:
        """One sample's vision tensors (see :meth:`mmrlhf.models.batch.SamplesVL.vision_inputs`)."""
        return slice_vision(
            index, self.image_num, self.video_num, self.pixel_values, self.image_grid_thws,
            self.pixel_values_videos, self.video_grid_thws,
        )
