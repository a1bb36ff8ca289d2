"""FSDP2 for a torchrun run: the sharding plan of :mod:`mmrlhf.models.sharding` applied with the run's switches
(mixed precision from ``model.dtype``, activation checkpointing)."""

from __future__ import annotations

from typing import Any

import torch

from mmrlhf.models.precision import precision


def mixed_precision_policy(compute_dtype: str) -> Any:
    """``model.dtype`` (the compute dtype) -> an FSDP2 ``MixedPrecisionPolicy``, None for float32. The models hold
    float32 parameters (:mod:`mmrlhf.models.precision`); the policy casts each unit's gathered parameters to the
    compute dtype for the forward and backward, reduces gradients in float32, and the optimiser steps the float32
    shards."""
    p = precision(compute_dtype)
    if p.autocast_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=p.compute, reduce_dtype=torch.float32)


def language_block_classes(actor: Any) -> list[str]:
    """The block classes that get their own FSDP unit in a training run: the language model's, not the vision
    tower's. Why: an FSDP unit gathers its parameters in a collective when its forward runs, so every rank must run
    it the same number of times. Every forward runs the decoder, but the vision tower only runs on a micro-batch
    that holds images or video: a text-only micro-batch on one rank next to an image one on another would leave the
    ranks waiting on each other. The tower's blocks therefore stay in the root unit, gathered with the rest of it at
    every forward of the actor."""
    from mmrlhf.models.sharding import block_modules

    tower, _ = actor.adapter.vision_parts(actor.model)
    in_tower = {id(m) for m in tower.modules()}
    return sorted({type(b).__name__ for b in block_modules(actor.model) if id(b) not in in_tower})


def shard_models(actor: Any, critic: Any | None, settings: Any, *, compute_dtype: str) -> None:
    """Shard the policy (and the critic) in place over the default process group; ``settings``: the
    ``distributed`` config section, ``compute_dtype``: ``model.dtype``. FSDP2's policy then casts the parameters,
    so the actor's own autocast is switched off (one mechanism per model)."""
    from mmrlhf.models.critic import CriticVL
    from mmrlhf.models.sharding import checkpoint_blocks, shard_for_training

    kwargs = {}
    mp = mixed_precision_policy(compute_dtype)
    if mp is not None:
        kwargs["mp_policy"] = mp
    for model in (actor, critic):
        if model is None:
            continue
        body = model.body if isinstance(model, CriticVL) else model
        body.compute_dtype = None  # FSDP2 casts the parameters (or the run is float32)
        blocks = language_block_classes(body)
        if settings.activation_checkpointing:
            checkpoint_blocks(model)
        shard_for_training(model, block_classes=blocks, **kwargs)
