"""Re-batching experience for training: split ``ExperienceVL`` micro-batches into per-sample items and collate any
selection of items into a :class:`TrainBatch`.

Why: the experience maker scores in micro-batches sized for no-grad forwards, while the update wants mini-batches
of ``train_batch_size`` samples in micro-batches of ``micro_train_batch_size``, shuffled anew every PPO epoch.
Items carry their prompt and response ids, their own vision tensors and their per-token tensors without padding;
collation lays them out again with the same builders the maker uses (padded, packed or grouped), so a training
forward sees exactly the sequences, M-RoPE positions and vision inputs the experience was scored on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from mmrlhf.experience.grouped import build_grouped_samples
from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.experience.types import ExperienceVL
from mmrlhf.models.batch import GroupedSamples, SamplesVL

# Per-token [B, A] fields of an Experience that training reads (None-valued ones are skipped).
TOKEN_FIELDS = ("action_log_probs", "base_action_log_probs", "values", "returns", "advantages", "kl",
                "action_entropy", "rollout_log_probs", "rollout_versions", "teacher_topk_log_probs",
                "teacher_topk_ids")  # the last two [B, A, k]: an item's are [A_i, k]
# Per-sample [B] tensors of Experience.info that travel with an item.
SAMPLE_INFO = ("reward", "raw_reward", "valid", "group", "response_length", "total_length", "truncated")


@dataclass
class TrainItem:
    """One sample of an experience, unpadded."""

    prompt_ids: list[int]
    response_ids: list[int]
    vision: dict[str, torch.Tensor]  # its pixel values and grids (processor keys)
    vision_extra: dict[str, torch.Tensor]  # per-video extras of its videos (e.g. second_per_grid_ts [videos])
    token: dict[str, torch.Tensor]  # per-token [A_i] tensors; "loss_mask" [A_i] bool (the experience's action_mask)
    info: dict[str, torch.Tensor] = field(default_factory=dict)  # per-sample 0-d tensors (reward, valid, group, ...)
    policy_mask: torch.Tensor | None = None  # [A_i] bool multi-turn: policy tokens (None: all response tokens)
    routed_experts: torch.Tensor | None = None  # [P_i + A_i, L, k] int16 the engine's experts per token (None: none)

    def with_token(self, **token: torch.Tensor) -> "TrainItem":
        """A new item with these per-token entries replaced or added; this one stays as it is (what a step's items
        were when they came is what a report, a retry or a re-score reads)."""
        return replace(self, token={**self.token, **token})


def inert_item(item: TrainItem) -> TrainItem:
    """A copy of ``item`` that trains nothing: no loss token, and marked invalid (as a sample the reward engine masked
    out), so it counts in no statistic of the step. What a rank with no sample of its own trains so that its
    forwards and update pair with the other ranks' (their sharded parameters are gathered in collectives)."""
    info = {**item.info, "valid": torch.tensor(False)} if "valid" in item.info else dict(item.info)
    return replace(item.with_token(loss_mask=torch.zeros_like(item.token["loss_mask"])), info=info)


@dataclass
class TrainBatch:
    """A collated selection of items: the samples for the forward plus aligned per-token tensors, on the CPU (the
    models move what they read, :mod:`mmrlhf.models.placement`)."""

    samples: SamplesVL | GroupedSamples  # layout for ActorVL / CriticVL (all response tokens are scored)
    vision_extra: dict[str, torch.Tensor]
    token: dict[str, torch.Tensor]  # [B, A] each; "loss_mask" [B, A] bool
    info: dict[str, torch.Tensor]  # [B] each

    @property
    def size(self) -> int:
        return self.samples.batch_size


def split_experience(exp: ExperienceVL) -> list[TrainItem]:
    """The samples of one experience micro-batch (padded or packed) as unpadded items, in order."""
    batch = int(exp.info["response_length"].shape[0])
    resp_len = exp.info["response_length"].tolist()
    total_len = exp.info["total_length"].tolist()
    if exp.packed_seq_lens is not None:
        ends = torch.cumsum(exp.packed_seq_lens, 0).tolist()
        spans = [(0, e - t, e) for e, t in zip(ends, total_len)]  # (row, first column, end column) of each sample
    else:
        width_a = exp.action_mask.shape[1]
        p_max = exp.sequences.shape[1] - width_a
        spans = [(i, p_max - (t - r), p_max + r) for i, (t, r) in enumerate(zip(total_len, resp_len))]
    rows = [exp.sequences[b, c0:c1].tolist() for b, c0, c1 in spans]
    routed = exp.routed_experts  # [B, S, L, k] | [1, T, L, k] | None
    video_num = exp.video_num or [0] * batch
    v_starts = torch.tensor([0, *video_num]).cumsum(0).tolist()
    items = []
    for i, (row, r) in enumerate(zip(rows, resp_len)):
        token = {name: getattr(exp, name)[i, :r] for name in TOKEN_FIELDS if getattr(exp, name) is not None}
        token["loss_mask"] = exp.action_mask[i, :r].bool()
        info = {k: exp.info[k][i] for k in SAMPLE_INFO if k in exp.info}
        extra = {k: v[v_starts[i]: v_starts[i + 1]] for k, v in (exp.vision_extra or {}).items()}
        policy = None if exp.policy_mask is None else exp.policy_mask[i, :r].bool()
        items.append(TrainItem(prompt_ids=row[: len(row) - r], response_ids=row[len(row) - r:],
                               vision=exp.vision_inputs(i), vision_extra=extra, token=token, info=info,
                               policy_mask=policy,
                               routed_experts=None if routed is None else routed[spans[i][0], spans[i][1]:spans[i][2]]))
    return items


def group_keys(items: Sequence[TrainItem]) -> list[Any]:
    """Per item, the key of its prompt group: the rollout's group id (unique within a step) where the item carries
    one, else its prompt ids."""
    return [int(it.info["group"]) if "group" in it.info else tuple(it.prompt_ids) for it in items]


def collate(items: Sequence[TrainItem], *, packed: bool, pad_id: int, adapter: Any, shared_prompt: bool = False,
            max_row_tokens: int | None = None) -> TrainBatch:
    """Lay ``items`` out as one batch (padded: left-padded prompts, right-padded responses; packed: [1, T];
    ``shared_prompt``: the grouped layout, one row per prompt of at most ``max_row_tokens``, which wins over
    ``packed``). Per-token tensors are [B, A] in item order whatever the layout."""
    if not items:
        raise ValueError("collate needs at least one item")
    prompts, responses = [it.prompt_ids for it in items], [it.response_ids for it in items]
    multi_turn = [it.policy_mask is not None for it in items]
    if any(multi_turn) and not all(multi_turn):
        raise ValueError("collate: multi-turn items (with a policy mask) and single-turn items cannot share a batch")
    masks = [it.policy_mask for it in items] if all(multi_turn) else None
    routed = [it.routed_experts for it in items]
    routed = None if all(r is None for r in routed) else routed
    if shared_prompt:
        built = build_grouped_samples(prompts, responses, pad_id=pad_id, eos_id=(), adapter=adapter,
                                      vision=[{**it.vision, **it.vision_extra} for it in items],
                                      max_row_tokens=max_row_tokens, response_masks=masks, routed_experts=routed)
    else:
        build = build_packed_samples if packed else build_padded_samples
        built = build(prompts, responses, pad_id=pad_id, eos_id=(), adapter=adapter,
                      vision=[it.vision for it in items], response_masks=masks, routed_experts=routed)
    a_max = max(len(it.response_ids) for it in items)
    token: dict[str, torch.Tensor] = {}
    for name in items[0].token:
        if any(name not in it.token for it in items):
            raise ValueError(f"per-token field {name!r} is present in some items only")
        token[name] = torch.stack([_pad(it.token[name], a_max) for it in items])  # [B, A]
    if shared_prompt:
        vision_extra = built.vision_extra  # per row, not per item
    else:
        extra_keys = sorted({k for it in items for k in it.vision_extra})
        vision_extra = {k: torch.cat([it.vision_extra[k] for it in items if k in it.vision_extra])
                        for k in extra_keys}
    info = {k: torch.stack([it.info[k] for it in items]) for k in items[0].info if all(k in it.info for it in items)}
    return TrainBatch(built.samples, vision_extra, token, info)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """[A_i, ...] -> [width, ...], zero / False padded on the right of the first (position) dimension."""
    if x.shape[0] >= width:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.ndim - 1) + (0, width - x.shape[0]))
