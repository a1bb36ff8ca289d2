"""What the LoRA-with-FSDP2 test and its worker build alike: the LoRA actor of a target set, and the loss."""

from __future__ import annotations

from typing import Any

import torch

from mmrlhf.config.model import LoraConfig
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.lora import apply_lora
from mmrlhf.trainer.optim import freeze_vision

TARGETS = {"language": "none", "tower": "tower", "unseeded": "none"}  # case -> model.lora.vision


def lora_actor(model: Any, adapter: Any, case: str, *, seed: int) -> ActorVL:
    """A float32 LoRA actor as the trainer builds it (tower frozen, then adapters drawn under ``seed``), with every
    B given values from ``seed`` as well (fresh adapters have B = 0, whose A gradients would be 0)."""
    actor = ActorVL(model, adapter, chunk_size=5)
    freeze_vision(actor.model, adapter, tower=True, merger=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        apply_lora(actor, LoraConfig(rank=4, alpha=8.0, vision=TARGETS[case]))
        with torch.no_grad():
            for name, p in actor.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    return actor


def lora_loss(res: Any, offset: int = 0) -> torch.Tensor:
    """A loss with per-sample weights (sample ``offset + i`` of the whole batch weighs ``cos(offset + i)``): a
    sum over samples, so the halves' losses add up to the whole batch's."""
    rows = torch.arange(res.log_probs.shape[0], dtype=torch.float32) + offset  # [B]
    return (res.log_probs * torch.cos(rows)[:, None]).sum()
