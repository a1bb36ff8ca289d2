"""Pushing the trained policy into the rollout engine after each update.

Only parameters that can have changed are sent (frozen ones, e.g. a frozen vision tower, are what the engine loaded
at start or at resume). The engine streams them in size-bounded buckets. Whether a sync worked is not judged by
the absence of an exception: every rollout compares the engine's log-probs of the sampled tokens with the
trainer's (``engine_logprob_diff/*``), which is the real check.

It lives with the engines it feeds, below the experience makers and the trainer: the trainer calls it after each
update, the experience builder after loading a LoRA adapter, and a Ray rollout actor after receiving new weights.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch


def policy_weights(model: torch.nn.Module, *, only_trainable: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs in transformers naming (detached; no copies), lazily: a parameter sharded by FSDP2 is
    gathered to its full value only when the consumer (the engine's bucketing) reaches it, so a sync never holds
    more than one bucket of gathered tensors. Sharded: every rank must consume the whole iterator, in order (each
    gather is a collective)."""
    for name, p in model.named_parameters():
        if p.requires_grad or not only_trainable:
            t = p.detach()
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def sync_weights(model: torch.nn.Module, engine: Any, *, only_trainable: bool = True) -> dict[str, float]:
    """Load the policy's current weights into ``engine``; returns ``sync/*`` metrics (seconds, tensors, MB)."""
    from mmrlhf.models.lora import lora_model

    if lora_model(model) is not None:
        return sync_lora(model, engine)
    t0 = time.perf_counter()
    nbytes = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal nbytes
        for name, t in policy_weights(model, only_trainable=only_trainable):
            nbytes += t.numel() * t.element_size()
            yield name, t

    loaded = engine.update_weights(counted())
    return {"sync/seconds": time.perf_counter() - t0, "sync/tensors": float(loaded), "sync/megabytes": nbytes / 2**20}


def sync_lora(model: torch.nn.Module, engine: Any) -> dict[str, float]:
    """The LoRA branch (``model.lora.rank > 0``). An engine built for adapters (``vllm_lora``: it has
    ``lora_enabled``) gets the peft adapter saved to a temporary folder (only A and B travel); any other engine
    gets the merged weights of the adapted layers (``merged``). A transformers engine that generates with the
    actor's own module (adapters included) needs nothing."""
    import tempfile

    from mmrlhf.models.lora import adapter_weights, merged_weights, save_adapter

    t0 = time.perf_counter()
    if getattr(engine, "model", None) is model:
        return {"sync/seconds": time.perf_counter() - t0, "sync/tensors": 0.0, "sync/megabytes": 0.0}
    if getattr(engine, "lora_enabled", False):
        with tempfile.TemporaryDirectory(prefix="mmrlhf-lora-sync-") as folder:
            save_adapter(model, folder)
            engine.load_lora_adapter(folder)
        sent = adapter_weights(model)
        nbytes, loaded = sum(t.numel() * t.element_size() for _, t in sent), len(sent)
    else:
        nbytes = 0

        def counted():
            nonlocal nbytes
            for name, t in merged_weights(model):
                nbytes += t.numel() * t.element_size()
                yield name, t

        loaded = engine.update_weights(counted())
    return {"sync/seconds": time.perf_counter() - t0, "sync/tensors": float(loaded), "sync/megabytes": nbytes / 2**20}
