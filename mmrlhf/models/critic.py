"""``CriticVL``: a Qwen-VL backbone with a scalar value head, scored at the same positions as the actor's
log-probs (the value of the state that precedes each response token).

Sharding (FSDP2): as for the actor (see :mod:`mmrlhf.models.sharding`), every transformer block gets its own
``fully_shard`` and the CRITIC is the root: its forward runs the backbone and the value head, so the parameters
outside the blocks (embeddings, final norm, value head) are gathered by the critic's own forward pre-hook.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmrlhf.models.actor import ActorVL, response_index
from mmrlhf.models.batch import SamplesVL
from mmrlhf.models.placement import module_device, to_device


class CriticVL(nn.Module):
    """Values [B, A] for either sample layout.

    Args:
        body: an :class:`ActorVL` whose decoder provides the hidden states (its lm_head is unused).
        value_head: maps hidden size -> 1; a zero-initialised ``nn.Linear`` by default, so a fresh critic predicts 0
            and GAE starts from plain returns instead of random values.
    """

    def __init__(self, body: ActorVL, value_head: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        if value_head is None:
            hidden = body.model.config.get_text_config().hidden_size  # not the lm_head (sharded under FSDP)
            value_head = nn.Linear(hidden, 1)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head

    @classmethod
    def from_pretrained(cls, path: str, **model_kwargs: Any) -> "CriticVL":
        return cls(ActorVL.from_pretrained(path, **model_kwargs))

    @property
    def device(self) -> torch.device:
        """Where this critic computes: its parameters' device (the rank's device under FSDP2)."""
        return module_device(self)

    def forward(self, samples: SamplesVL, *, vision_extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Values [B, A] on this critic's device; the inputs may be anywhere (they are moved there first, see
        :mod:`mmrlhf.models.placement`)."""
        samples, vision_extra = to_device((samples, vision_extra), self.device)
        hidden = self.body.hidden_states(samples, vision_extra)  # [B, S, H] | [1, T, H]; checks the layout
        src, _, action_mask = response_index(samples)  # [N], [N], [B, A]
        h = hidden.reshape(-1, hidden.shape[-1])[src]  # [N, H]
        v = self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()  # [N]
        return v.new_zeros(action_mask.shape).masked_scatter(action_mask, v)  # [B, A]


def freeze_unused_head(model: nn.Module) -> None:
    """The critic never reads the language-model head: frozen (in place), unless it is tied to the input embeddings
    (which the critic does read). Done where a critic is sharded for training (:func:`~mmrlhf.models.sharding.
    shard_for_training`), which owns the model by then. Why: a trainable parameter the forward never uses would
    still get a zero gradient under FSDP2's reduce-scatter of unused parameters (:func:`~mmrlhf.models.sharding.
    reduce_unused_parameters`), and with it AdamW moments the size of the vocabulary times the hidden size. (Unsharded,
    its gradient stays None and AdamW skips it.)"""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or (embed is not None and head.weight is embed.weight):
        return
    head.weight.requires_grad_(False)
