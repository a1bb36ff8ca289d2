"""The one precision rule of the trained models: ``model.dtype`` names the COMPUTE dtype; what the parameters are
stored in follows from it.

Why: AdamW steps the parameters in their own dtype. With bfloat16 parameters an update of ``lr`` ~ 1e-6 on a weight
of 0.02 is below half a bf16 ulp (0.02 has an ulp of 2^-13 ~ 1.2e-4) and rounds away: measured on the toy recipe,
0.76% of the weights moved in 4 steps against 69.9% in float32. So the trained models (actor, critic) keep float32
MASTER parameters, gradients and optimiser state, and compute in ``model.dtype``:

* one process and the Ray trainer actor: the forwards run under ``torch.autocast(dtype=compute)``
  (:func:`autocast`, entered by :class:`~mmrlhf.models.actor.ActorVL` itself, so every caller gets it);
* torchrun: FSDP2's ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`` casts the float32 shards
  for each forward (:mod:`mmrlhf.models.sharding`), and the actor's own autocast is switched off.

Models that never train (the reference) are stored in the compute dtype: they need no master copy, and that
halves their memory. float16 compute would need a gradient scaler (its gradients underflow); the config refuses it
for the trained models (``model.dtype``) instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run, from ``model.dtype``."""

    compute: torch.dtype  # what the forwards and backwards of every model run in
    master: torch.dtype  # trainable models' parameters, gradients and optimiser state (float32 below fp32 compute)
    frozen: torch.dtype  # models that never train (the reference): stored in the compute dtype

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype a trained model's forward autocasts to (None: it computes in its parameters' own dtype)."""
        return self.compute if self.compute != self.master else None


def precision(model_dtype: str) -> Precision:
    """``model.dtype`` -> the run's dtypes (float32 stays float32 everywhere)."""
    compute = DTYPES[model_dtype]
    master = torch.float32 if compute in (torch.bfloat16, torch.float16) else compute
    return Precision(compute=compute, master=master, frozen=compute)


def autocast(device: torch.device, dtype: torch.dtype | None) -> ContextManager[None]:
    """``torch.autocast`` on ``device``'s type to ``dtype``; a no-op context for None. Matrix products run in
    ``dtype``; autocast keeps reductions and norms in float32, and the gradients reach the float32 parameters in
    float32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def lora_base_dtype(model_cfg: Any, device: torch.device | str) -> torch.dtype:
    """``model.lora.base_dtype`` of a ``model`` config section resolved: ``auto`` is the compute dtype on an
    accelerator, the master dtype (float32) on the CPU."""
    key = model_cfg.lora.base_dtype
    if key == "auto":
        p = precision(model_cfg.dtype)
        return p.master if torch.device(device).type == "cpu" else p.compute
    return DTYPES[key]


def store_frozen_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every ``nn.Linear`` of ``model`` whose parameters are all frozen in ``dtype`` (``model.lora.base_dtype``);
    returns the elements cast. Why only those: a frozen weight never steps, so it needs no float32 master, and a
    Linear under autocast computes in the compute dtype anyway, from the same rounded values. Embeddings and norms
    are not Linear and keep their dtype (the residual stream they feed stays float32); a Linear whose weight is
    tied to an embedding keeps it too (the embedding's lookup would change)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    cast = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or id(module.weight) in embeddings:
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if any(p.requires_grad for p in params) or all(p.dtype == dtype for p in params):
            continue
        module.to(dtype)
        cast += sum(p.numel() for p in params)
    return cast
