"""Where a model's inputs and outputs live: one rule for every model the framework runs.

1. Batches are built on the CPU: the builders (:mod:`mmrlhf.experience.samples`, :mod:`~mmrlhf.experience.grouped`,
   :func:`~mmrlhf.experience.batching.collate`) are pure functions with no device.
2. A model wrapper (:class:`~mmrlhf.models.actor.ActorVL`, :class:`~mmrlhf.models.critic.CriticVL`, and what
   delegates to them: the LoRA reference :class:`~mmrlhf.models.lora.AdapterOffScorer`) moves its inputs to the
   device of its own parameters (:func:`module_device`) as the first thing its forward does, with
   :func:`to_device`. Callers never move a batch for a model, so no caller can forget to.
3. Outputs stay on the model's device (training needs their autograd graph there); whatever a caller combines
   with them (the update's old log-probs, advantages, masks) it brings to ``output.device``. Results that outlive
   the step go to the CPU with :func:`to_host`: experiences are plain CPU data, which a trainer in another process
   may consume, and the advantage code then never mixes devices.

Copies into an accelerator are ``non_blocking``: from pageable memory the copy is still complete with respect to
the source when it returns (the driver stages it), so it is safe, and from pinned memory it overlaps. Batches are
not pinned here: each tensor crosses once, right before the forward that reads it, so pinning would add a host copy
and overlap nothing (pin where a batch is built ahead of its use). Copies to the CPU block: their values are read
at once.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")


def module_device(module: nn.Module) -> torch.device:
    """The device ``module`` computes on: that of its first parameter (else buffer; CPU for neither).

    FSDP2 (``fully_shard``): parameters are DTensors whose ``device`` is the rank's device, where the all-gathered
    weights live, so a sharded model answers its rank's accelerator. A model still on ``meta`` (not materialised)
    answers ``meta``, and its forward fails in its first operation as it would without the move.
    """
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def to_device(obj: T, device: torch.device | str) -> T:
    """``obj`` with every tensor inside it on ``device``; ``obj`` itself is left as it was.

    Walks tensors, dataclasses (a shallow copy with moved fields: a samples batch keeps its type), NamedTuples,
    lists, tuples and dicts; other values are shared. A tensor already there is not copied.
    """
    device = torch.device(device)
    non_blocking = device.type != "cpu"  # into an accelerator: see the module docstring; to the CPU: blocking

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x if x.device == device else x.to(device, non_blocking=non_blocking)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            out = copy.copy(x)
            for f in dataclasses.fields(x):
                object.__setattr__(out, f.name, move(getattr(x, f.name)))
            return out
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple
            return type(x)(*(move(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(move(v) for v in x)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    return move(obj)


def to_host(obj: T) -> T:
    """``obj`` with every tensor on the CPU (rule 3 of the module docstring)."""
    return to_device(obj, "cpu")
