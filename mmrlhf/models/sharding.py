"""How the actor and the critic are sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 gathers a unit's parameters in the forward pre-hook of the module it was applied to and frees them after,
so a parameter is a full tensor only inside the forward of the unit that owns it. :class:`~mmrlhf.models.actor.
ActorVL` runs the HF base model and then reads ``lm_head.weight`` itself (the chunked log-prob head never calls the
lm_head's forward, so that no [N, V] logits exist); :class:`~mmrlhf.models.critic.CriticVL` runs the same base model
and its value head. Both do all of it inside their OWN ``forward``. Hence the plan :func:`shard_for_training`
applies, and that a distributed trainer must follow:

1. every transformer block of the HF model (the classes the model lists in ``_no_split_modules``: its decoder
   layers and its vision-tower blocks, e.g. ``Qwen2VLDecoderLayer`` and ``Qwen2VLVisionBlock``) gets its own
   ``fully_shard``: gathered for its forward only;
2. then the wrapper itself (the ``ActorVL`` / ``CriticVL``) gets ``fully_shard``, as the root. Everything outside
   the blocks (token embeddings, final norm, the lm_head, tied to the embeddings or not, the vision patch embedding
   and merger(s), the critic's value head) belongs to this root unit and is gathered for the wrapper's whole
   forward, so the chunked head sees the full lm_head and its gradient is reduce-scattered after the backward.

Never ``fully_shard`` the HF model itself, its lm_head or its input embeddings: the wrapper uses their parameters
without calling their forward, so FSDP would leave them sharded. The wrapper refuses such a layout with a clear
error (:mod:`mmrlhf.models.fsdp_layout`) instead of failing inside a DTensor op. ``ActorVL.hidden_states`` is
registered as a forward method of a sharded actor, so calling it directly gathers as ``forward`` does.

The frozen models that score beside the policy (the reference, a distillation teacher) follow the same plan
(:func:`shard_for_scoring`, through :func:`shard_models`' ``scorers``): every rank holds a shard of each, and each of
their forwards is a collective like the policy's.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.critic import CriticVL, freeze_unused_head
from mmrlhf.models.fsdp_layout import check_wrapper_layout

logger = logging.getLogger(__name__)


def block_modules(model: nn.Module, block_classes: Iterable[str] | None = None) -> list[nn.Module]:
    """The transformer blocks of ``model`` that get their own FSDP unit, in module order.

    ``block_classes``: class names; default the model's ``_no_split_modules`` (how transformers names its decoder
    layers and vision blocks).
    """
    names = set(block_classes if block_classes is not None else (getattr(model, "_no_split_modules", None) or ()))
    if not names:
        raise ValueError(f"{type(model).__name__} lists no _no_split_modules: pass block_classes explicitly")
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"no module of {type(model).__name__} is one of the block classes {sorted(names)}")
    return blocks


def shard_for_training(wrapper: nn.Module, *, block_classes: Iterable[str] | None = None,
                       **fully_shard_kwargs: Any) -> nn.Module:
    """Apply the plan of this module to an :class:`ActorVL` or :class:`CriticVL` (in place; returns it).

    ``fully_shard_kwargs`` (``mesh``, ``mp_policy``, ``reshard_after_forward``, ...) go to every ``fully_shard``
    call. Needs an initialised process group (as ``fully_shard`` does).
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if isinstance(wrapper, ActorVL):
        actor = wrapper
    elif isinstance(wrapper, CriticVL):
        actor = wrapper.body
        freeze_unused_head(actor.model)  # before any unit is made: its lm_head trains nothing
    else:
        raise TypeError(f"expected an ActorVL or a CriticVL, got {type(wrapper).__name__}")
    check_wrapper_layout(actor.model)
    for block in block_modules(actor.model, block_classes):
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(wrapper, **fully_shard_kwargs)
    reduce_unused_parameters(wrapper)
    if isinstance(wrapper, ActorVL):
        register_fsdp_forward_method(wrapper, "hidden_states")
    return wrapper


def shard_for_scoring(actor: nn.Module, *, block_classes: Iterable[str] | None = None,
                      **fully_shard_kwargs: Any) -> nn.Module:
    """The same plan for a frozen :class:`ActorVL` that only scores (the reference, a distillation teacher): every
    block its own unit, the wrapper the root; no gradients, so nothing to reduce-scatter. Like the policy's, its
    forwards are collectives: every rank must run as many as the others (the experience maker's padding forwards
    run it too, :mod:`mmrlhf.parallel.aligned`). In place; returns it."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if not isinstance(actor, ActorVL):
        raise TypeError(f"expected an ActorVL, got {type(actor).__name__}")
    trained = [n for n, p in actor.named_parameters() if p.requires_grad]
    if trained:
        raise ValueError(f"shard_for_scoring is for frozen models; {type(actor).__name__} trains {trained[0]!r} "
                         f"(and {len(trained) - 1} more): use shard_for_training")
    check_wrapper_layout(actor.model)
    for block in block_modules(actor.model, block_classes):
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(actor, **fully_shard_kwargs)
    register_fsdp_forward_method(actor, "hidden_states")
    return actor


def reduce_unused_parameters(wrapper: nn.Module) -> None:
    """Make every rank reduce-scatter every trainable parameter of every unit, used in its backward or not.

    Why: FSDP2 reduce-scatters, after a unit's backward, only the parameters that got a gradient. A micro-batch
    without images or video never runs the vision tower (its patch embedding, blocks and merger sit in the root
    unit), so a rank whose micro-batch is text-only beside one whose micro-batch has images would send a smaller
    reduce-scatter than the other expects: a collective mismatch (gloo aborts, NCCL hangs or corrupts). Mixed
    text / image data, an inert sample beside a share with images and a padding forward all meet this. With the
    switch, an unused parameter contributes a zero gradient: the sum over ranks is the gradient of the ranks that
    used it, as one process on the whole batch computes it. (A step in which no rank used the tower leaves it a
    zero gradient, where one process leaves none: AdamW's decoupled weight decay then still applies to it.)"""
    switch = getattr(wrapper, "set_reduce_scatter_unused_params", None)
    if switch is None:
        logger.warning("this torch's FSDP2 cannot reduce-scatter unused parameters (set_reduce_scatter_unused_params, "
                       "torch %s): ranks must not mix text-only micro-batches with ones that hold images or video",
                       torch.__version__)
        return
    switch(True)


# ---- the training plan with a run's switches (any world of more than one rank) ----------------------------------

def mixed_precision_policy(compute_dtype: str) -> Any:
    """``model.dtype`` (the compute dtype) -> an FSDP2 ``MixedPrecisionPolicy``, None for float32. The models hold
    float32 parameters (:mod:`mmrlhf.models.precision`); the policy casts each unit's gathered parameters to the
    compute dtype for the forward and backward, reduces gradients in float32, and the optimiser steps the float32
    shards."""
    from mmrlhf.models.precision import precision

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
    tower, _ = actor.adapter.vision_parts(actor.model)
    in_tower = {id(m) for m in tower.modules()}
    return sorted({type(b).__name__ for b in block_modules(actor.model) if id(b) not in in_tower})


def offload_policy(offload: str, device: torch.device) -> Any:
    """``distributed.offload`` -> FSDP2's ``OffloadPolicy``: ``params`` keeps every shard, its gradient and (the
    optimiser being built on the parameters) its AdamW moments in host memory, pinned when the models compute on an
    accelerator (the copies to it then overlap); None for ``none``."""
    if offload == "none":
        return None
    if offload != "params":
        raise ValueError(f"unknown distributed.offload {offload!r}; valid: none, params")
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


def shard_models(actor: Any, critic: Any | None, *, compute_dtype: str, offload: str = "none",
                 scorers: Iterable[Any] = ()) -> None:
    """Shard the policy (and the critic) in place over the default process group; ``compute_dtype``:
    ``model.dtype``; ``offload``: ``distributed.offload`` (:func:`offload_policy`). FSDP2's policy then casts the
    parameters, so the actor's own autocast is switched off (one mechanism per model). Activation checkpointing
    (:mod:`mmrlhf.models.gradient_checkpointing`) is applied before this.

    ``scorers``: the frozen models this rank scores with (the reference, a distillation teacher: :class:`ActorVL`
    stored in ``model.dtype``), sharded by the same plan (:func:`shard_for_scoring`) and offloaded with the same
    policy: under ``params`` their weights live in host memory and each unit is copied to the device for its
    forward. They need no cast (stored in the compute dtype already). Anything else in ``scorers`` (a LoRA run's
    reference, the actor's own module with its adapters off) is the actor's and is skipped."""
    kwargs = {}
    mp = mixed_precision_policy(compute_dtype)
    if mp is not None:
        kwargs["mp_policy"] = mp
    host = offload_policy(offload, next(actor.parameters()).device)
    if host is not None:
        kwargs["offload_policy"] = host
    for model in (actor, critic):
        if model is None:
            continue
        body = getattr(model, "body", model)  # a CriticVL wraps an actor-like body
        body.compute_dtype = None  # FSDP2 casts the parameters (or the run is float32)
        shard_for_training(model, block_classes=language_block_classes(body), **kwargs)
    frozen = {"offload_policy": host} if host is not None else {}
    for model in scorers:
        if not isinstance(model, ActorVL) or model is actor:
            continue
        shard_for_scoring(model, block_classes=language_block_classes(model), **frozen)
