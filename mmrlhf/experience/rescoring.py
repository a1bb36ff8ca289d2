"""Scoring a step's train items again with a model of this rank: the Ray trainer actors' forwards over what the
rollout actors sent (the policy's log-probs: the sync check and, with ``max_staleness >= 1``, the PPO ratio's old
policy; the reference's and the distillation teacher's where the trainer actors hold them,
:func:`~mmrlhf.models.ray_placement.reference_on_trainers`, :func:`~mmrlhf.models.ray_placement.teacher_on_trainers`).

The micro-batches are planned by cost (the rollout's scoring split, :mod:`mmrlhf.parallel.micro_batches`) and
agreed over the world: a sharded model's forwards are collectives (:mod:`mmrlhf.parallel.aligned`), so every rank
runs as many, a padding forward's result being dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mmrlhf.experience.batching import TrainItem, collate
from mmrlhf.experience.costs import forward_layout, item_costs
from mmrlhf.experience.rollout import ScoringDistribution
from mmrlhf.models.placement import to_host
from mmrlhf.parallel.aligned import run_aligned
from mmrlhf.parallel.micro_batches import Budget, plan_micro_batches
from mmrlhf.parallel.world import World, single


@dataclass(frozen=True)
class ItemLayout:
    """How the items are laid out for the forwards (the updates' layout keys) and the pad id."""

    pad_id: int
    packing: bool = False
    shared_prompt: bool = False
    shared_prompt_max_tokens: int | None = None


def _forwards(model: Any, items: Sequence[TrainItem], distribution: ScoringDistribution, layout: ItemLayout,
              world: World | None, *, micro_batch_size: int, max_tokens: Budget, **call: Any) -> list[tuple]:
    """(item indices, the model's output on the CPU) per real micro-batch, planned and agreed over ``world``."""
    world = world or single()
    adapter = model.adapter
    shape = forward_layout(packing=layout.packing, shared_prompt=layout.shared_prompt,
                           max_row_tokens=layout.shared_prompt_max_tokens)
    plan = plan_micro_batches(item_costs(items, adapter=adapter, grouped=layout.shared_prompt),
                              [list(range(len(items)))], shape, samples=micro_batch_size, tokens=max_tokens,
                              world=world)

    def forward(micro: list[int], padding: bool) -> tuple[list[int], Any]:
        batch = collate([items[i] for i in micro], packed=layout.packing, pad_id=layout.pad_id, adapter=adapter,
                        shared_prompt=layout.shared_prompt, max_row_tokens=layout.shared_prompt_max_tokens)
        return micro, to_host(model(batch.samples, vision_extra=batch.vision_extra,
                                    temperature=distribution.temperature, truncation=distribution.truncation, **call))

    return run_aligned(plan.micro_batches[0], forward, pad=[0] if items else None)


@torch.no_grad()
def score_items(model: Any, items: Sequence[TrainItem], distribution: ScoringDistribution, layout: ItemLayout,
                world: World | None = None, *, micro_batch_size: int,
                max_tokens: Budget) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """[A_i] float32 log-probs of each item's response under ``model`` (an :class:`~mmrlhf.models.actor.ActorVL`,
    sharded or whole) at ``distribution``, in item order, and [A_i] bool: the token lies outside the model's kept
    set (all False untruncated)."""
    log_probs, outside, _ = _scores(model, items, distribution, layout, world, entropy=False,
                                    micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    return log_probs, outside


@torch.no_grad()
def score_items_with_entropy(model: Any, items: Sequence[TrainItem], distribution: ScoringDistribution,
                             layout: ItemLayout, world: World | None = None, *, micro_batch_size: int,
                             max_tokens: Budget) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """:func:`score_items` and each item's [A_i] float32 per-token entropy of ``model``'s distribution (the old
    policy's ``action_entropy``, as the experience maker records it: the same temperature and truncation)."""
    return _scores(model, items, distribution, layout, world, entropy=True, micro_batch_size=micro_batch_size,
                   max_tokens=max_tokens)


def _scores(model: Any, items: Sequence[TrainItem], distribution: ScoringDistribution, layout: ItemLayout,
            world: World | None, *, entropy: bool, micro_batch_size: int, max_tokens: Budget) -> tuple[list, list, list]:
    n = len(items)
    log_probs: list[Any] = [None] * n
    outside: list[Any] = [None] * n
    entropies: list[Any] = [None] * n
    for micro, out in _forwards(model, items, distribution, layout, world, micro_batch_size=micro_batch_size,
                                max_tokens=max_tokens, **({"return_entropy": True} if entropy else {})):
        cut = out.outside if out.outside is not None else torch.zeros_like(out.action_mask)
        for j, i in enumerate(micro):
            a = len(items[i].response_ids)
            log_probs[i], outside[i] = out.log_probs[j, :a].float(), cut[j, :a].bool()  # [b, A] -> [A_i]
            if entropy:
                entropies[i] = out.entropy[j, :a].float()
    return log_probs, outside, entropies


@torch.no_grad()
def with_teacher(teacher: Any, items: Sequence[TrainItem], distribution: ScoringDistribution, layout: ItemLayout,
                 world: World | None = None, *, topk: int, micro_batch_size: int,
                 max_tokens: Budget) -> list[TrainItem]:
    """``items`` with the distillation teacher's ``topk`` most likely tokens at each response position
    (``teacher_topk_log_probs`` [A_i, k] float32, ``teacher_topk_ids`` [A_i, k] int32), as the experience maker
    records them for the loss term."""
    out = list(items)
    for micro, res in _forwards(teacher, items, distribution, layout, world, micro_batch_size=micro_batch_size,
                                max_tokens=max_tokens, topk=topk):
        for j, i in enumerate(micro):
            a = len(items[i].response_ids)
            out[i] = out[i].with_token(teacher_topk_log_probs=res.topk_log_probs[j, :a].float(),
                                       teacher_topk_ids=res.topk_ids[j, :a].to(torch.int32))
    return out


def with_reference(items: Sequence[TrainItem], log_probs: Sequence[torch.Tensor], ref_log_probs: Sequence[torch.Tensor],
                   estimator: str, world: World | None = None) -> tuple[list[TrainItem], dict[str, float]]:
    """``items`` with the reference's log-probs (``base_action_log_probs``, [A_i]) and the per-token KL estimate
    of ``log_probs`` (the policy's, [A_i] each) against them (``kl``), as the experience maker records them, and
    the step's ``kl/mean`` over every rank's response tokens (a collective over ``world``: each rank logs the
    step's value)."""
    from mmrlhf.algorithms.kl import approx_kl

    world = world or single()
    out, total, count = [], 0.0, 0.0
    for it, lp, ref in zip(items, log_probs, ref_log_probs, strict=True):
        mask = it.token["loss_mask"]
        kl = approx_kl(lp[None], ref[None], mask[None], estimator)[0]  # [A_i], 0 off the mask
        total, count = total + float(kl[mask].sum()), count + float(mask.sum())
        out.append(it.with_token(base_action_log_probs=ref, kl=kl))
    total, count = world.all_sum([total, count])
    return out, {"kl/mean": total / count if count else 0.0}
