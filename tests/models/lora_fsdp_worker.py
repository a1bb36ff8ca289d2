"""One rank of the LoRA-with-FSDP2 test (run by test_lora_fsdp.py under ``torchrun --nproc-per-node 2``, gloo, CPU).

Per target set (``language``: the default language-model targets; ``tower``: the same plus every Linear of the vision
blocks, which then train): the LoRA actor is built as the trainer builds it (fresh adapters drawn from one seed),
sharded by ``shard_for_training`` with the trainer's language blocks, and each rank scores and backpropagates its half
of the mixed batch (padded); the all-gathered adapter gradients, the merged weights the engine sync sends (gathered
from the shards) and the adapter as a checkpoint writes it (rank 0) go to ``--out``. The control ``unseeded`` draws
each rank's adapters from its own seed: the shards then hold two different initialisations.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lora_fsdp_common import lora_actor, lora_loss  # noqa: E402
from models_testing import load_bundle, sharded_batches  # noqa: E402

from mmrlhf.models.lora import merged_weights, save_lora_checkpoint  # noqa: E402
from mmrlhf.models.sharding import language_block_classes, shard_for_training  # noqa: E402


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run(case: str, rank: int, world: int, out: Path, mesh) -> None:
    bundle = load_bundle("qwen2_vl")
    actor = lora_actor(copy.deepcopy(bundle.model), bundle.adapter, case, seed=0 if case != "unseeded" else rank)
    shard_for_training(actor, mesh=mesh, block_classes=language_block_classes(actor))
    samples, extra = sharded_batches(bundle, rank, world)["padded"]
    res = actor(samples, vision_extra=extra)
    lora_loss(res, offset=rank * res.log_probs.shape[0]).backward()  # FSDP averages: the test divides by the world
    results = {f"grad.{n}": full(p.grad) for n, p in actor.named_parameters() if p.grad is not None}
    for name, t in merged_weights(actor.model):  # every rank gathers, in order
        results[f"merged.{name}"] = t.detach().clone()
    save_lora_checkpoint(actor.model, out / case, write=rank == 0)
    if rank == 0:
        torch.save(results, out / f"{case}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # a CPU check wherever it runs (see fsdp_worker.py)
    try:
        for case in args.cases:
            run(case, dist.get_rank(), dist.get_world_size(), Path(args.out), mesh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
