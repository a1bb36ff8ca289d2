"""Mixture-of-experts math: the router's load-balancing loss and the routing metrics (expert load, engine vs
trainer agreement). Pure tensor functions; which experts a forward used comes from
:mod:`mmrlhf.models.routing`, the engine's from the rollout (``rollout.routing_replay``).

Index tensors are [N, L, k] (tokens, decoder layers, top-k), vLLM's layout; a negative index means "no routing
here" (a dense layer, a padding token, the last sampled token): such (token, layer) pairs are left out.
"""

from __future__ import annotations

from typing import Sequence

import torch


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int,
                        token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer auxiliary loss as transformers computes it (``load_balancing_loss_func``), pooled over
    the routed layers: ``E * sum_{j, e} f_{j, e} * P_e`` with ``f_{j, e}`` the fraction of tokens whose j-th choice
    is expert e and ``P_e`` the mean router probability of e, both over (layer, token) pairs. A uniform router
    scores ``top_k``; one that puts all its probability on a single expert scores ``E``.

    ``router_logits``: one [N, E] tensor per routed layer (the same N tokens). ``token_mask`` [N] bool: tokens that
    count (padding excluded); None counts all. Returns a scalar float32, differentiable in the logits (only through
    ``P``: the top-k choice has no gradient, as in the paper)."""
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    logits = torch.cat([t.float() for t in router_logits], dim=0)  # [L*N, E]
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1)  # [L*N, E]
    chosen = torch.topk(probs, top_k, dim=-1).indices  # [L*N, k]
    one_hot = torch.nn.functional.one_hot(chosen, num_experts).float()  # [L*N, k, E]
    if token_mask is None:
        weight = torch.ones(logits.shape[0], device=logits.device)
    else:
        weight = token_mask.to(logits.device).float().repeat(len(router_logits))  # [L*N]
    count = weight.sum().clamp(min=1.0)
    f = (one_hot * weight[:, None, None]).sum(0) / count  # [k, E]
    p = (probs * weight[:, None]).sum(0) / count  # [E]
    return (f * p[None]).sum() * num_experts


def expert_load(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[L, E] float: per layer, the fraction of routed (token, slot) pairs that went to each expert (each row sums
    to 1; a layer with no routed token is all zeros). ``indices`` [N, L, k], negatives ignored."""
    idx = indices.long()
    valid = idx >= 0  # [N, L, k]
    one_hot = torch.nn.functional.one_hot(idx.clamp(min=0), num_experts).float() * valid[..., None]  # [N, L, k, E]
    counts = one_hot.sum(dim=(0, 2))  # [L, E]
    return counts / counts.sum(dim=-1, keepdim=True).clamp(min=1.0)


def load_imbalance(load: torch.Tensor) -> torch.Tensor:
    """[L] max over mean expert load of each layer (1 = perfectly balanced, E = one expert takes everything);
    ``load`` from :func:`expert_load`. A layer with no routed token gives 0."""
    mean = load.mean(dim=-1)  # [L]
    return torch.where(mean > 0, load.max(dim=-1).values / mean.clamp(min=1e-12), torch.zeros_like(mean))


def routing_agreement(engine: torch.Tensor, trainer: torch.Tensor) -> dict[str, float]:
    """How often the trainer routed as the engine did, over the (token, layer) pairs both routed (``[N, L, k]``
    each, negatives = not routed).

    ``set``: fraction of pairs whose top-k SETS are equal (the order of the k choices does not change the output);
    ``overlap``: mean fraction of the engine's k experts that the trainer also chose; ``pairs``: how many pairs
    were compared. Both fractions are 1.0 when no pair is comparable (nothing disagrees)."""
    if engine.shape != trainer.shape:
        raise ValueError(f"routing_agreement: engine {tuple(engine.shape)} vs trainer {tuple(trainer.shape)}")
    a, b = engine.long(), trainer.long()
    both = (a >= 0).all(-1) & (b >= 0).all(-1)  # [N, L]
    pairs = int(both.sum())
    if pairs == 0:
        return {"set": 1.0, "overlap": 1.0, "pairs": 0.0}
    a, b = a[both], b[both]  # [P, k]
    same_set = (a.sort(-1).values == b.sort(-1).values).all(-1)  # [P]
    shared = (a[:, :, None] == b[:, None, :]).any(-1).float().mean(-1)  # [P] engine choices the trainer kept
    return {"set": float(same_set.float().mean()), "overlap": float(shared.mean()), "pairs": float(pairs)}


def routing_metrics(trainer: torch.Tensor, num_experts: int, engine: torch.Tensor | None = None,
                    prefix: str = "moe/") -> dict[str, float]:
    """The logged metrics of one step's routing: ``load_imbalance`` (max / mean expert load, averaged over the
    routed layers), ``load_max_frac`` (largest single expert's share, worst layer) and, with the engine's routing,
    ``routing_agree_set`` / ``routing_agree_overlap`` (:func:`routing_agreement`)."""
    load = expert_load(trainer, num_experts)  # [L, E]
    routed = load.sum(-1) > 0  # [L]
    out = {
        f"{prefix}load_imbalance": float(load_imbalance(load)[routed].mean()) if routed.any() else 0.0,
        f"{prefix}load_max_frac": float(load.max()) if routed.any() else 0.0,
    }
    if engine is not None:
        agree = routing_agreement(engine, trainer)
        out[f"{prefix}routing_agree_set"] = agree["set"]
        out[f"{prefix}routing_agree_overlap"] = agree["overlap"]
    return out


def step_routing_metrics(parts: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, float]:
    """:func:`routing_metrics` over a step's scoring forwards: ``parts`` holds per forward (the trainer's own
    top-k [N_i, L, k], the engine's [N_i, L, k], the number of experts)."""
    trainer = torch.cat([p[0].long() for p in parts])  # [N, L, k]
    engine = torch.cat([p[1].long() for p in parts])  # [N, L, k]
    return routing_metrics(trainer, int(parts[0][2]), engine)
