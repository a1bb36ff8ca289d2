"""The critic (value) update of PPO: the clipped value loss of ``mmrlhf.algorithms.losses.value_loss`` against the
returns of the experience, over shuffled mini-batches, with its own optimiser (same skeleton and guard as the
policy update)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mmrlhf.algorithms.losses import value_loss
from mmrlhf.algorithms.masked import agg_count
from mmrlhf.experience.batching import TrainItem, collate, group_keys
from mmrlhf.experience.costs import forward_layout, item_costs
from mmrlhf.models.placement import to_device
from mmrlhf.parallel.micro_batches import Budget
from mmrlhf.trainer.minibatch import GuardedStepper, run_minibatches


@dataclass(frozen=True)
class CriticUpdateSettings:
    train_batch_size: int = 128
    micro_batch_size: int = 4
    ppo_epochs: int = 1
    value_clip: float | None = 0.2
    value_loss_coef: float = 0.5
    agg: str = "token-mean"
    norm_len: int | None = None
    packing: bool = False
    shared_prompt: bool = False  # grouped layout (each prompt once per row); wins over packing
    shared_prompt_max_tokens: int | None = None
    max_tokens_per_micro_batch: Budget = None  # as PolicyUpdateSettings'
    shuffle: bool = True


class CriticUpdater:
    """Runs the value update of one step on a :class:`~mmrlhf.models.critic.CriticVL`."""

    def __init__(self, critic: Any, stepper: GuardedStepper, settings: CriticUpdateSettings, *, pad_id: int,
                 adapter: Any) -> None:
        self.critic, self.stepper, self.s = critic, stepper, settings
        self.pad_id, self.adapter = pad_id, adapter

    def update(self, items: Sequence[TrainItem], *, generator: torch.Generator | None) -> dict[str, float]:
        s = self.s
        if not all("values" in it.token and "returns" in it.token for it in items):
            raise ValueError("the critic update needs old values and returns in the experience (a critic in the maker)")
        # The value loss trains on every response token of a valid sample, not only the policy's selected ones.
        counts = [float(agg_count(it.token["loss_mask"][None], s.agg)) for it in items]
        self.critic.eval()  # no dropout: values are compared with the old values (see the policy update)

        def micro_loss(micro: list[int], denom: float) -> tuple[torch.Tensor, dict]:
            batch = collate([items[i] for i in micro], packed=s.packing, pad_id=self.pad_id,
                            adapter=self.adapter, shared_prompt=s.shared_prompt,
                            max_row_tokens=s.shared_prompt_max_tokens)  # on the CPU; the critic moves it
            values = self.critic(batch.samples, vision_extra=batch.vision_extra)  # [b, A]
            tok = to_device(batch.token, values.device)  # the loss's other inputs join the outputs
            loss, metrics = value_loss(values, tok["values"], tok["returns"], tok["loss_mask"], clip=s.value_clip,
                                       agg=s.agg, norm_len=s.norm_len)
            share = sum(counts[i] for i in micro) / max(denom, 1.0)  # the micro-batch mean -> its share of the mini
            return s.value_loss_coef * loss * share, metrics

        return run_minibatches(counts, batch_size=s.train_batch_size, micro_size=s.micro_batch_size,
                               epochs=s.ppo_epochs, generator=generator if s.shuffle else None, stepper=self.stepper,
                               micro_loss=micro_loss, prefix="critic/",
                               groups=group_keys(items),
                               costs=item_costs(items, adapter=self.adapter, grouped=s.shared_prompt),
                               layout=forward_layout(packing=s.packing, shared_prompt=s.shared_prompt,
                                                     max_row_tokens=s.shared_prompt_max_tokens),
                               max_tokens=s.max_tokens_per_micro_batch)
