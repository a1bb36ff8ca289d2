"""The process group of a ``torchrun`` run, seen by the trainer: who am I, how many are we, and the few collectives
the loop needs (sums of metric tallies, an agreement on "every rank's loss was finite", a broadcast of a path).

The single-process run has no context (``None``); every helper here takes the context or ``None`` so the loop reads
the same either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # where this rank's tensors and collectives live

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- collectives (every rank must call them, in the same order) --------------------------------------------
    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts and loss sums add exactly)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks (e.g. the most micro-batches any rank holds)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def all_true(self, flag: bool) -> bool:
        """True only if ``flag`` holds on every rank (e.g. every rank's loss was finite)."""
        return self.all_sum([0.0 if flag else 1.0])[0] == 0.0

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def init_from_env(process_group: str = "auto", environ: Mapping[str, str] = os.environ) -> DistContext:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``).

    ``process_group``: ``auto`` -> torch's default backend for the accelerator torch reports (nccl on CUDA), each rank
    on device ``LOCAL_RANK`` of it; gloo on the CPU without one. ``gloo``: CPU tensors; ``nccl``: needs that
    accelerator."""
    import torch.distributed as dist

    from mmrlhf.devices import resolve_device

    rank, world, local = int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"])
    accelerator = resolve_device("auto")  # the CPU when torch reports no accelerator
    if process_group == "gloo" or (process_group == "auto" and accelerator.type == "cpu"):
        backend, device = "gloo", torch.device("cpu")
    else:
        if accelerator.type == "cpu":
            raise ValueError("distributed.process_group=nccl needs a GPU; use gloo (or auto) on the CPU")
        device = torch.device(accelerator.type, local)
        torch.accelerator.set_device_index(local)
        backend = process_group if process_group != "auto" else dist.get_default_backend_for_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistContext(rank=rank, world_size=world, local_rank=local, device=device)


def destroy() -> None:
    """Leave the process group. An in-process vLLM engine made its own groups on top of ours (its tensor-parallel
    group of one rank); they go first, through vLLM's own teardown, or vLLM's exit hook would later try to destroy
    them after the default group, which invalidates them, and fail."""
    import sys

    import torch.distributed as dist

    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None:
        vllm_groups.destroy_model_parallel()
        vllm_groups.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def local_share(n: int, ctx: DistContext | None, what: str) -> int:
    """``n / world_size`` (``n`` itself without a context); ``what`` names the key in the error when it does not
    divide."""
    if ctx is None:
        return n
    if n % ctx.world_size:
        raise ValueError(f"{what}={n} must be a multiple of the number of ranks ({ctx.world_size}) under torchrun")
    return n // ctx.world_size


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value gathered to its full tensor; a plain tensor as it is. Collective for DTensors."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
