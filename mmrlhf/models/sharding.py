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
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.critic import CriticVL
from mmrlhf.models.fsdp_layout import check_wrapper_layout


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
    else:
        raise TypeError(f"expected an ActorVL or a CriticVL, got {type(wrapper).__name__}")
    check_wrapper_layout(actor.model)
    for block in block_modules(actor.model, block_classes):
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(wrapper, **fully_shard_kwargs)
    if isinstance(wrapper, ActorVL):
        register_fsdp_forward_method(wrapper, "hidden_states")
    return wrapper


def checkpoint_blocks(wrapper: nn.Module, *, block_classes: Iterable[str] | None = None) -> int:
    """Activation checkpointing (``distributed.activation_checkpointing``) on every transformer block of an
    :class:`ActorVL` / :class:`CriticVL`: a block keeps only its inputs in the forward and recomputes its activations
    in the backward. Applied with torch's composable ``checkpoint``, which leaves parameter names unchanged (the
    weight sync and the Hugging Face checkpoints keep working) and composes with ``fully_shard`` (apply it first).

    Why not transformers' gradient checkpointing: it only acts in training mode, and the trainer keeps the policy in
    eval mode (no dropout, so the PPO ratio compares like with like). Returns the number of blocks."""
    from torch.distributed._composable import checkpoint

    if isinstance(wrapper, CriticVL):
        wrapper = wrapper.body
    if not isinstance(wrapper, ActorVL):
        raise TypeError(f"expected an ActorVL or a CriticVL, got {type(wrapper).__name__}")
    blocks = block_modules(wrapper.model, block_classes)
    for block in blocks:
        checkpoint(block)
    return len(blocks)
