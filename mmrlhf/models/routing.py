"""Routing replay for mixture-of-experts decoders: record which experts the trainer's routers pick, or make them
pick the experts the rollout engine picked.

Why: a routed-experts layer is discontinuous. Engine and trainer compute the router logits with different
kernels (and, on GPUs, in bf16), so near-tie tokens route to different experts in the two, and the trainer then
scores a token with a different sub-network than the one that sampled it: its log-prob, the PPO ratio and the
rollout correction all move by far more than the numeric noise (measured in
tests/models/test_models_routing_replay.py). Replaying the engine's expert choice (Routing Replay, "R3", as in
verl / slime / SGLang) removes that term: the trainer keeps its own router PROBABILITIES (so the gate weights of
the chosen experts, and the router's gradient, are the trainer's) but at the engine's indices.

The routers are found by duck typing, not by class names (the families live in ``adapters.py``): a module with
integer ``top_k`` and ``num_experts`` and a [num_experts, hidden] ``weight``, whose forward maps the flattened
hidden states [N, H] to ``(router_logits [N, E], scores [N, k], indices [N, k])`` (transformers 5's
``...TopKRouter``). Its layer is the decoder layer index in its module name (``...layers.<i>.mlp.gate``): the
index vLLM's routed-experts arrays use (``[tokens, num_hidden_layers, top_k]``, dense layers included).

Token order: the router sees ``hidden.reshape(-1, H)``, so the N rows are the batch's tokens in row-major order:
[B, S] padded -> B * S rows, [1, T] packed -> T rows. A replay tensor is laid out the same way ([B, S, L, k] or
[1, T, L, k], flattened here); a negative index marks a token with no engine routing (padding, the last sampled
token, which the engine never ran through the model): that token keeps the trainer's own top-k.

Patching is per call and undone on exit (an instance ``forward`` over the class's), so a model outside the
context is untouched; it composes with FSDP2 (its hooks sit on the decoder layers, not on the routers) and with
activation checkpointing (a recomputed layer replays the same indices; a recorded one is recorded again).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

ROUTING_MODES = ("none", "record", "replay")
_LAYER = re.compile(r"layers\.(\d+)\.")


def is_router(module: nn.Module) -> bool:
    """Whether ``module`` looks like a top-k router (see the module docstring)."""
    weight = getattr(module, "weight", None)
    top_k, experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
    return (isinstance(top_k, int) and isinstance(experts, int) and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and weight.shape[0] == experts)


def find_routers(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its router, for every routed layer of ``model`` (empty for a dense model)."""
    routers: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if not is_router(module):
            continue
        found = _LAYER.findall(name)
        if not found:
            raise ValueError(f"router {name!r}: no decoder layer index in its name (expected '...layers.<i>...')")
        layer = int(found[-1])
        if layer in routers:
            raise ValueError(f"two routers in decoder layer {layer} ({name!r}): routing replay cannot tell them apart")
        routers[layer] = module
    return dict(sorted(routers.items()))


def replay_scores(router_logits: torch.Tensor, indices: torch.Tensor, *, renormalise: bool = True) -> torch.Tensor:
    """Gate weights of the experts ``indices`` [N, k] under ``router_logits`` [N, E]: the softmax probabilities
    (float32, as the routers compute them) gathered at the indices, renormalised to sum to one per token when the
    router renormalises its top-k. Returns [N, k] float32; differentiable in the logits. With the router's own
    top-k indices this is exactly the router's own scores (same ops, same order)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    scores = probs.gather(-1, indices.long())  # [N, k]
    return scores / scores.sum(dim=-1, keepdim=True) if renormalise else scores


@dataclass
class RoutingTrace:
    """What the routers of one forward did, per decoder layer (routed layers only)."""

    indices: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, k] long, the experts used
    own: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, k] the router's own top-k (before any
    #   replay: what the trainer would have chosen; the routing-agreement metric compares it with the engine's)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, E] router logits (with grad)
    num_experts: int = 0
    top_k: int = 0
    token_mask: torch.Tensor | None = None  # [N] bool real (not padding) tokens, set by the caller that knows

    def stacked(self, num_layers: int, which: str = "indices") -> torch.Tensor:
        """[N, num_layers, k] long: the ``indices`` used (or the routers' ``own`` choice) in vLLM's layout; -1 in
        layers without a router and, where ``token_mask`` is set, at padding tokens."""
        per_layer = getattr(self, which)
        first = next(iter(per_layer.values()))
        out = torch.full((first.shape[0], num_layers, first.shape[1]), -1, dtype=torch.long, device=first.device)
        for layer, idx in per_layer.items():
            out[:, layer] = idx
        if self.token_mask is not None:
            out[~self.token_mask.to(out.device)] = -1
        return out


@contextmanager
def routing(model: nn.Module, *, replay: torch.Tensor | None = None, record: bool = False,
            keep_logits: bool = False) -> Iterator[RoutingTrace]:
    """Patch every router of ``model`` for the block.

    ``replay``: [N, L, k] (or [B, S, L, k] / [1, T, L, k], flattened to the router's N rows) expert indices to
    use instead of the routers' own top-k; negative entries keep the router's own choice for that token.
    ``record``: store each layer's indices (as used, after any replay) in the yielded trace. ``keep_logits``:
    store each layer's router logits too (with their graph: the load-balancing loss differentiates them).
    A model without routers yields an empty trace and runs unchanged; a replay tensor for one raises.
    """
    routers = find_routers(model)
    trace = RoutingTrace()
    if replay is not None:
        if not routers:
            raise ValueError("routing replay asked for a model without routed experts")
        replay = replay.reshape(-1, *replay.shape[-2:])  # [N, L, k]
        if replay.shape[1] <= max(routers):
            raise ValueError(f"replay indices cover {replay.shape[1]} layers; the model routes in layer "
                             f"{max(routers)}")
    if replay is None and not record and not keep_logits:
        yield trace
        return
    for router in routers.values():
        trace.num_experts, trace.top_k = int(router.num_experts), int(router.top_k)
    patched = []
    try:
        for layer, router in routers.items():
            router.forward = _patched_forward(router, layer, replay, record, keep_logits, trace)
            patched.append(router)
        yield trace
    finally:
        for router in patched:
            del router.forward  # back to the class's forward


def _patched_forward(router: nn.Module, layer: int, replay: torch.Tensor | None, record: bool, keep_logits: bool,
                     trace: RoutingTrace):
    original = type(router).forward
    renormalise = bool(getattr(router, "norm_topk_prob", True))  # the Qwen routers renormalise unconditionally

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        logits, scores, indices = original(router, hidden_states, *args, **kwargs)  # [N, E], [N, k], [N, k]
        if record:
            trace.own[layer] = indices.detach()
        if replay is not None:
            given = replay[:, layer].to(device=indices.device, dtype=torch.long)  # [N, k]
            if given.shape != indices.shape:
                raise ValueError(f"layer {layer}: replay indices {tuple(given.shape)} for a router that routes "
                                 f"{tuple(indices.shape)} (tokens, top_k): the batch layout and the routing "
                                 "disagree")
            own = (given < 0).any(dim=-1, keepdim=True)  # [N, 1] tokens without engine routing
            indices = torch.where(own, indices, given)
            scores = replay_scores(logits, indices, renormalise=renormalise).to(scores.dtype)
        if record:
            trace.indices[layer] = indices.detach()
        if keep_logits:
            trace.logits[layer] = logits
        return logits, scores, indices

    return forward
