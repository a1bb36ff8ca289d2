"""Pushing the trained policy into the rollout engine after each update.

Only parameters that can have changed are sent (frozen ones, e.g. a frozen vision tower, are what the engine loaded
at start or at resume). The engine streams them in size-bounded buckets. Whether a sync worked is not judged by
the absence of an exception: every rollout compares the engine's log-probs of the sampled tokens with the
trainer's (``engine_logprob_diff/*``), which is the real check.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def policy_weights(model: torch.nn.Module, *, only_trainable: bool = True) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs in transformers naming (detached; no copies)."""
    return [(name, p.detach()) for name, p in model.named_parameters() if p.requires_grad or not only_trainable]


def sync_weights(model: torch.nn.Module, engine: Any, *, only_trainable: bool = True) -> dict[str, float]:
    """Load the policy's current weights into ``engine``; returns ``sync/*`` metrics (seconds, tensors, MB)."""
    t0 = time.perf_counter()
    weights = policy_weights(model, only_trainable=only_trainable)
    loaded = engine.update_weights(iter(weights))
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    return {"sync/seconds": time.perf_counter() - t0, "sync/tensors": float(loaded), "sync/megabytes": nbytes / 2**20}
