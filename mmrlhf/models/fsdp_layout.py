"""The FSDP2 layouts an ``ActorVL`` / ``CriticVL`` refuses: the HF model, its lm_head or its input embeddings as an
FSDP unit of its own.

The wrapper reads their parameters outside their forward (the chunked log-prob head never calls the lm_head), where
FSDP leaves them sharded; a clear error here beats a failure inside a DTensor op. The plan that avoids it is
:mod:`mmrlhf.models.sharding`, which applies it to the wrappers; this check sits below them so that the actor can
run it on every forward.
"""

from __future__ import annotations

from typing import Any


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing can be sharded
        return None
    return FSDPModule


def check_wrapper_layout(model: Any) -> None:
    """Raise if ``model`` (an HF ``...ForConditionalGeneration``), its lm_head or its input embeddings is an FSDP unit
    of its own: the wrapper reads their parameters outside their forward, where FSDP leaves them sharded."""
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return
    parts = {"the model": model, "its lm_head": model.get_output_embeddings(),
             "its input embeddings": model.get_input_embeddings()}
    for name, module in parts.items():
        if isinstance(module, fsdp):
            raise RuntimeError(
                f"{name} was given its own fully_shard; the actor / critic uses its parameters outside its forward, "
                "where FSDP leaves them sharded. Shard the transformer blocks, then the ActorVL / CriticVL as the "
                "root (mmrlhf.models.sharding.shard_for_training)."
            )
