"""One rank of the FSDP2 test (run by test_models_fsdp.py under ``torchrun --nproc-per-node 2``, gloo, CPU).

Per family: the actor and the critic are sharded with ``shard_for_training``; each rank scores its own contiguous
half of the test batch (padded and packed), backpropagates, and the full (all-gathered) gradients, its log-probs,
values and hidden states are written to ``--out`` for the test to compare against one unsharded process. The wrong
layout (the HF model sharded on its own) is tried too, for the first family, and its error recorded.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models_testing import load_bundle, random_value_head, sharded_batches  # noqa: E402

from mmrlhf.models.actor import ActorVL  # noqa: E402
from mmrlhf.models.critic import CriticVL  # noqa: E402
from mmrlhf.models.sharding import block_modules, shard_for_training  # noqa: E402


def full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> full gradient (all-gathered from the shards; every rank must call this)."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
    module.zero_grad(set_to_none=True)
    return out


def run_family(family: str, rank: int, world: int, out: Path, try_wrong_layout: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    results: dict[str, torch.Tensor] = {}
    bundle = load_bundle(family)
    critic_model, wrong_model = copy.deepcopy(bundle.model), copy.deepcopy(bundle.model)  # before any sharding
    parts = sharded_batches(bundle, rank, world)  # layout -> (samples, vision_extra) of this rank's half
    actor = shard_for_training(ActorVL(bundle.model, bundle.adapter, chunk_size=5))
    for layout, (samples, extra) in parts.items():
        res = actor(samples, vision_extra=extra, return_entropy=True)
        (res.log_probs.sum() + 0.1 * res.entropy.sum()).backward()
        results[f"actor.{layout}.log_probs"] = res.log_probs.detach()
        results[f"actor.{layout}.entropy"] = res.entropy.detach()
        for name, g in full_grads(actor).items():
            results[f"actor.{layout}.grad.{name}"] = g
    with torch.no_grad():  # a direct call of the public method (the critic's and a trainer's way in)
        samples, extra = parts["packed"]
        results["actor.hidden_states"] = actor.hidden_states(samples, vision_extra=extra).detach()

    head = random_value_head(bundle.model.config.get_text_config().hidden_size)  # non-zero gradients everywhere
    critic = shard_for_training(CriticVL(ActorVL(critic_model, bundle.adapter), head))
    samples, extra = parts["padded"]
    values = critic(samples, vision_extra=extra)
    values.sum().backward()
    results["critic.values"] = values.detach()
    for name, g in full_grads(critic).items():
        results[f"critic.grad.{name}"] = g

    error = None
    if try_wrong_layout:  # the wrong plan: the HF model as its own root
        for block in block_modules(wrong_model):
            fully_shard(block)
        fully_shard(wrong_model)
        try:
            ActorVL(wrong_model, bundle.adapter)(samples, vision_extra=extra)
            error = ""
        except RuntimeError as exc:
            error = str(exc)
    torch.save(results, out / f"{family}.rank{rank}.pt")
    (out / f"{family}.rank{rank}.json").write_text(json.dumps({"wrong_layout_error": error, "world": world}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("families", nargs="+")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for k, family in enumerate(args.families):
            run_family(family, dist.get_rank(), dist.get_world_size(), Path(args.out), try_wrong_layout=k == 0)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
