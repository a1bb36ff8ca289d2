"""FSDP2 for a torchrun run: the sharding plan of :mod:`mmrlhf.models.sharding` applied with the run's switches
(mixed precision, activation checkpointing)."""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(name: str) -> Any:
    """``distributed.mixed_precision`` -> an FSDP2 ``MixedPrecisionPolicy`` (None for ``none``): parameters are cast
    to the low precision for the forward and backward; gradients are reduced in float32 and the optimiser steps on
    the parameters' own dtype."""
    if name == "none":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_DTYPES[name], reduce_dtype=torch.float32)


def shard_models(actor: Any, critic: Any | None, settings: Any) -> None:
    """Shard the policy (and the critic) in place over the default process group; ``settings``: the
    ``distributed`` config section."""
    from mmrlhf.models.sharding import checkpoint_blocks, shard_for_training

    kwargs = {}
    mp = mixed_precision_policy(settings.mixed_precision)
    if mp is not None:
        kwargs["mp_policy"] = mp
    for model in (actor, critic):
        if model is None:
            continue
        if settings.activation_checkpointing:
            checkpoint_blocks(model)
        shard_for_training(model, **kwargs)
