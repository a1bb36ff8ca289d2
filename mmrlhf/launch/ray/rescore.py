"""The trainer ranks' re-scoring of the experiences the rollout actors sent: each rank's items under its own policy.

Why: a sample was drawn by an engine in another process; the trainer's log-probs of it are the sync check of the
weights (with ``max_staleness = 0``) and the PPO ratio's old policy (with ``k >= 1``, at the trainer's version).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mmrlhf.experience.rollout import ScoringDistribution
from mmrlhf.parallel.world import World


def rescore(policy: Any, items: Sequence[Any], distribution: ScoringDistribution, world: World, *,
            micro_batch_size: int, max_tokens: int | str | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """[A_i] log-probs of each item's response under ``policy`` (a PolicyUpdater) at the rollout's
    ``distribution``, in item order, and [A_i] bool:
    the token lay outside this policy's kept set (all False untruncated). The micro-batches are planned by cost
    (``max_tokens``, :mod:`mmrlhf.parallel.micro_batches`) and every rank runs as many forwards as the plan agrees
    on (sharded forwards are collective); a padding forward repeats a micro-batch and is dropped."""
    from mmrlhf.experience.batching import collate
    from mmrlhf.experience.costs import forward_layout, item_costs
    from mmrlhf.models.placement import to_host
    from mmrlhf.parallel.micro_batches import plan_micro_batches

    s, actor = policy.s, policy.actor
    actor.eval()
    layout = forward_layout(packing=s.packing, shared_prompt=s.shared_prompt, max_row_tokens=s.shared_prompt_max_tokens)
    plan = plan_micro_batches(item_costs(items, adapter=actor.adapter, grouped=s.shared_prompt),
                              [list(range(len(items)))], layout, samples=micro_batch_size, tokens=max_tokens,
                              world=world)
    out: list[torch.Tensor | None] = [None] * len(items)
    outside: list[torch.Tensor | None] = [None] * len(items)
    first = next((m for m in plan.micro_batches[0] if m), list(range(min(len(items), 1))))
    with torch.no_grad():
        for micro in plan.micro_batches[0]:
            part = [items[i] for i in micro or first]
            batch = collate(part, packed=s.packing, pad_id=policy.pad_id, adapter=actor.adapter,
                            shared_prompt=s.shared_prompt, max_row_tokens=s.shared_prompt_max_tokens)
            scored = to_host(actor(batch.samples, vision_extra=batch.vision_extra,
                                   temperature=distribution.temperature, truncation=distribution.truncation))
            cut = scored.outside if scored.outside is not None else torch.zeros_like(scored.action_mask)
            for j, i in enumerate(micro):  # none for a padding forward
                out[i] = scored.log_probs[j, : len(items[i].response_ids)].float()  # [b, A] -> [A_i]
                outside[i] = cut[j, : len(items[i].response_ids)].bool()
    return out, outside
