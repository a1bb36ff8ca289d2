"""Activation (gradient) checkpointing of the trained models (``trainer.gradient_checkpointing``): each checkpointed
transformer block keeps only its inputs in the forward and recomputes its activations when the backward needs them.

What it trades: one extra forward of every checkpointed block per training micro-batch (about a third more compute
for the update) for the activations of the blocks' insides, which autograd would otherwise keep from the forward to
the backward (attention projections, MLP intermediates, norms: measured numbers in docs/training.md).

How, and why not the other ways:

* transformers' ``gradient_checkpointing_enable`` acts only in training mode (5.19's ``GradientCheckpointingLayer``
  checks ``self.training``), and the trainer keeps the policy and the critic in EVAL mode (no dropout, so that the
  PPO ratio and the value clip compare like with like: :class:`~mmrlhf.trainer.policy_update.PolicyUpdater`). There
  it would silently do nothing.
* torch's composable ``checkpoint`` (``torch.distributed._composable``) works in eval mode but prepares its
  recomputation (RNG states, autocast state, mode stack) in a hook before it looks whether gradients are enabled:
  every no-grad forward pays that for every block (measured ~0.2 ms per block call on the CPU; the scoring forwards
  and the transformers rollout engine, which generates with the actor's own module, one call per block per token).
* here, each block's ``forward`` becomes :func:`_forward_with_recompute`: under ``torch.no_grad`` /
  ``inference_mode`` it is the block's own forward (nothing stored, nothing recomputed, nothing prepared); with
  gradients it is ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Non-reentrant because the
  reentrant variant gives no gradient to the parameters inside a block whose inputs do not require grad (LoRA with
  frozen embeddings), and cannot run a backward over part of the graph. The recomputation runs under the autocast
  state of the original forward (torch records it and re-enters it), so bf16 compute over float32 master weights
  recomputes in bf16 exactly as it first ran. Parameter names do not change (the weight sync, the checkpoints and
  peft see the same model).

Which blocks (:func:`checkpointed_blocks`): every language-model block; the vision tower's blocks only when some
parameter of the tower trains (``trainer.freeze_vision_tower=false``, or ``model.lora.vision=tower | both``). A
frozen tower takes pixel values that need no gradient: autograd keeps nothing inside its blocks, so recomputing
them would cost a forward and save no memory. Decided when checkpointing is applied: after the freezing and the
adapters.

FSDP2 (``fully_shard`` per block, :mod:`mmrlhf.models.sharding`): apply the checkpointing first. The recomputation
runs inside the block's backward, after FSDP2's pre-backward hook has gathered the block's parameters again (and,
with a ``MixedPrecisionPolicy``, cast them), so it computes with the same full parameters as the forward did.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.critic import CriticVL
from mmrlhf.models.sharding import block_modules


def _forward_with_recompute(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a checkpointed ``block``: its class's own forward, wrapped in a non-reentrant checkpoint when
    gradients are enabled (see the module docstring)."""
    forward = type(block).forward.__get__(block)  # the class's forward (FSDP2 swaps the class for a subclass)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    """Whether :func:`checkpoint_blocks` wrapped ``block``'s forward."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _forward_with_recompute


def _actor_of(wrapper: nn.Module) -> ActorVL:
    if isinstance(wrapper, CriticVL):
        return wrapper.body
    if isinstance(wrapper, ActorVL):
        return wrapper
    raise TypeError(f"expected an ActorVL or a CriticVL, got {type(wrapper).__name__}")


def checkpointed_blocks(wrapper: nn.Module) -> list[nn.Module]:
    """The blocks of an :class:`ActorVL` / :class:`CriticVL` whose recomputation saves memory, in module order: the
    language model's blocks, plus the vision tower's when a parameter of the tower (its mergers excluded: they run
    after the blocks) requires grad NOW (call after freezing and LoRA)."""
    actor = _actor_of(wrapper)
    tower, mergers = actor.adapter.vision_parts(actor.model)
    merger_params = {id(p) for m in mergers for p in m.parameters()}
    tower_trains = any(p.requires_grad for p in tower.parameters() if id(p) not in merger_params)
    in_tower = {id(m) for m in tower.modules()}
    return [b for b in block_modules(actor.model) if tower_trains or id(b) not in in_tower]


def checkpoint_blocks(wrapper: nn.Module) -> list[nn.Module]:
    """Checkpoint :func:`checkpointed_blocks` of ``wrapper`` in place (before any ``fully_shard``); returns them.
    Refuses a block checkpointed twice (a second wrap would recompute twice) or one whose forward was replaced."""
    blocks = checkpointed_blocks(wrapper)
    for block in blocks:
        if "forward" in block.__dict__:
            what = "is already checkpointed" if is_checkpointed(block) else "has a replaced forward"
            raise ValueError(f"trainer.gradient_checkpointing: {type(block).__name__} {what}; apply it once, to a "
                             "model whose blocks run their class's forward")
    for block in blocks:
        # a partial, not a closure: a deep copy of the model gets a forward bound to the copied block
        block.forward = functools.partial(_forward_with_recompute, block)
    return blocks
