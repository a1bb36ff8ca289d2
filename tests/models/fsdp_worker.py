"""One rank of the FSDP2 test (run by test_models_fsdp.py under ``torchrun --nproc-per-node 2``, gloo, CPU).

Per family: the actor and the critic are sharded with ``shard_for_training``; each rank scores its own contiguous
half of the test batch (padded and packed), backpropagates, and the full (all-gathered) gradients, its log-probs,
values and hidden states are written to ``--out`` for the test to compare against one unsharded process. A second
actor is checkpointed (``trainer.gradient_checkpointing``) before it is sharded and trained on the packed half, with
the calls of its blocks' Linear layers counted (recomputed blocks run them twice). The wrong layout (the HF model
sharded on its own) is tried too, for the first family, and its error recorded. Everything stays on the CPU (gloo,
a CPU mesh), also where a GPU is visible.
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
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models_testing import (  # noqa: E402
    IMAGE_ROWS,
    TEXT_ROWS,
    LinearCalls,
    load_bundle,
    picked_batch,
    random_value_head,
    sharded_batches,
)

from mmrlhf.models.actor import ActorVL  # noqa: E402
from mmrlhf.models.critic import CriticVL  # noqa: E402
from mmrlhf.models.gradient_checkpointing import checkpoint_blocks  # noqa: E402
from mmrlhf.models.sharding import block_modules, language_block_classes, shard_for_training  # noqa: E402


def full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> full gradient (all-gathered from the shards; every rank must call this)."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
    module.zero_grad(set_to_none=True)
    return out


def run_family(family: str, rank: int, world: int, out: Path, try_wrong_layout: bool, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    results: dict[str, torch.Tensor] = {}
    bundle = load_bundle(family)
    # before any sharding
    critic_model, wrong_model, ckpt_model, mixed_model = (copy.deepcopy(bundle.model) for _ in range(4))
    parts = sharded_batches(bundle, rank, world)  # layout -> (samples, vision_extra) of this rank's half
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5)
    # trainer.gradient_checkpointing: checkpointed first, then sharded (every block trains here, vision ones too)
    ckpt = ActorVL(ckpt_model, bundle.adapter, chunk_size=5)
    checkpoint_blocks(ckpt)
    counters = {"actor": LinearCalls(actor), "actor_ckpt": LinearCalls(ckpt)}  # before fully_shard renames classes
    calls: dict[str, dict[str, int]] = {"actor": {}, "actor_ckpt": {}}
    actor, ckpt = shard_for_training(actor, mesh=mesh), shard_for_training(ckpt, mesh=mesh)
    for prefix, model in (("actor", actor), ("actor_ckpt", ckpt)):
        for layout, (samples, extra) in parts.items():
            if prefix == "actor_ckpt" and layout != "packed":
                continue
            before = counters[prefix].total
            res = model(samples, vision_extra=extra, return_entropy=True)
            (res.log_probs.sum() + 0.1 * res.entropy.sum()).backward()
            results[f"{prefix}.{layout}.log_probs"] = res.log_probs.detach()
            results[f"{prefix}.{layout}.entropy"] = res.entropy.detach()
            for name, g in full_grads(model).items():
                results[f"{prefix}.{layout}.grad.{name}"] = g
            calls[prefix][layout] = counters[prefix].total - before
    with torch.no_grad():  # a direct call of the public method (the critic's and a trainer's way in)
        samples, extra = parts["packed"]
        results["actor.hidden_states"] = actor.hidden_states(samples, vision_extra=extra).detach()

    # The training plan (language blocks their own units, the tower in the root): rank 0's micro-batch text-only,
    # rank 1's with images, so the tower's parameters get a gradient on rank 1 only.
    mixed = ActorVL(mixed_model, bundle.adapter, chunk_size=5)
    mixed = shard_for_training(mixed, block_classes=language_block_classes(mixed), mesh=mesh)
    built = picked_batch(bundle, TEXT_ROWS if rank == 0 else IMAGE_ROWS)
    res = mixed(built.samples, vision_extra=built.vision_extra)
    res.log_probs.sum().backward()
    for name, g in full_grads(mixed).items():
        results[f"mixed.grad.{name}"] = g

    head = random_value_head(bundle.model.config.get_text_config().hidden_size)  # non-zero gradients everywhere
    critic = shard_for_training(CriticVL(ActorVL(critic_model, bundle.adapter), head), mesh=mesh)
    samples, extra = parts["padded"]
    values = critic(samples, vision_extra=extra)
    values.sum().backward()
    results["critic.values"] = values.detach()
    for name, g in full_grads(critic).items():
        results[f"critic.grad.{name}"] = g

    error = None
    if try_wrong_layout:  # the wrong plan: the HF model as its own root
        for block in block_modules(wrong_model):
            fully_shard(block, mesh=mesh)
        fully_shard(wrong_model, mesh=mesh)
        try:
            ActorVL(wrong_model, bundle.adapter)(samples, vision_extra=extra)
            error = ""
        except RuntimeError as exc:
            error = str(exc)
    torch.save(results, out / f"{family}.rank{rank}.pt")
    (out / f"{family}.rank{rank}.json").write_text(json.dumps({"wrong_layout_error": error, "world": world,
                                                               "linear_calls": calls}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("families", nargs="+")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    # A CPU check wherever it runs: FSDP2's default mesh is on the accelerator torch finds (CUDA where one is
    # visible), which would move the shards off the CPU this test compares against.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        for k, family in enumerate(args.families):
            run_family(family, dist.get_rank(), dist.get_world_size(), Path(args.out), try_wrong_layout=k == 0,
                       mesh=mesh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
