"""``World``: who am I among the ranks that train this run, and the few collectives the loop needs.

Every launch mode trains through the same loop; what differs is how many ranks train and who made their process
group (torchrun, the Ray trainer actors). One process is a world of one rank whose collectives return their input,
so the trainer reads the same whether it runs alone or beside others: there is no "no context" case.

Collectives must be called by every rank, in the same order. Numbers travel as float64 (counts and loss sums add
exactly); objects (metric dicts, paths, experiences handed out by rank 0) travel over ``object_group``, a gloo
group on the CPU, so they never occupy an accelerator's collective stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

LAUNCH_MODES = ("single", "torchrun", "ray")


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where collectives' tensors live
    launch: str = "single"  # the launch mode that made this world (recorded in checkpoints)
    object_group: Any = None  # process group for object collectives (None: the default group)

    def __post_init__(self) -> None:
        if self.launch not in LAUNCH_MODES:
            raise ValueError(f"unknown launch mode {self.launch!r}; known: {LAUNCH_MODES}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run's output (metrics, reports, the progress bar, checkpoint metadata)."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the models are sharded over the ranks (FSDP2): any world of more than one rank."""
        return self.world_size > 1

    # ---- collectives --------------------------------------------------------------------------------------------
    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""
        return self._reduce(values, "SUM")

    def all_max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks (e.g. the most micro-batches any rank holds)."""
        return self._reduce(values, "MAX")

    def all_true(self, flag: bool) -> bool:
        """True only if ``flag`` holds on every rank (e.g. every rank's loss was finite)."""
        return self.all_sum([0.0 if flag else 1.0])[0] == 0.0

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.object_group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.object_group)
        return out

    def scatter_objects(self, parts: Sequence[Any] | None) -> Any:
        """Rank 0 hands ``parts[r]`` to rank ``r`` (``parts`` is ignored on the other ranks); returns this rank's."""
        if self.world_size == 1:
            if parts is None or len(parts) != 1:
                raise ValueError("scatter_objects in a world of one rank needs exactly one part")
            return parts[0]
        import torch.distributed as dist

        if self.is_main and (parts is None or len(parts) != self.world_size):
            raise ValueError(f"scatter_objects: rank 0 must give {self.world_size} parts")
        box: list[Any] = [None]
        dist.scatter_object_list(box, list(parts) if self.is_main else None, src=0, group=self.object_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.object_group)

    def share(self, n: int, what: str) -> int:
        """``n / world_size``; ``what`` names the key in the error when it does not divide."""
        if n % self.world_size:
            raise ValueError(f"{what}={n} must be a multiple of the number of training ranks ({self.world_size})")
        return n // self.world_size

    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t.tolist()


def single(device: torch.device | str = "cpu") -> World:
    """The world of a one-process run."""
    return World(device=torch.device(device))


def join(rank: int, world_size: int, local_rank: int, *, launch: str, process_group: str = "auto",
         init_method: str | None = None, local_world_size: int | None = None, host_tensors: bool = False) -> World:
    """Join (or make) the default process group of ``world_size`` ranks and return this rank's world.

    ``process_group``: ``auto`` -> torch's default backend for the accelerator torch reports (nccl on CUDA), each rank
    on device ``local_rank`` of it; gloo on the CPU without one. ``gloo``: CPU tensors; ``nccl``: needs that
    accelerator. ``init_method``: a ``tcp://host:port`` rendezvous (the Ray trainer actors); None reads
    ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment (torchrun). Object collectives get a gloo group of their
    own when the main group is not gloo. ``local_world_size``: the ranks on this node (torchrun's
    ``LOCAL_WORLD_SIZE``): every one of them checks that the node has a device for each, before any touches one.
    ``host_tensors``: collectives on host-memory tensors too (``distributed.offload``: the offloaded shards' gradient
    norm and gathers); an accelerator group then routes CPU tensors to gloo (``cuda:nccl,cpu:gloo``)."""
    import torch.distributed as dist

    from mmrlhf.devices import resolve_device

    accelerator = resolve_device("auto")  # the CPU when torch reports no accelerator
    if process_group == "gloo" or (process_group == "auto" and accelerator.type == "cpu"):
        backend, device = "gloo", torch.device("cpu")
    else:
        if accelerator.type == "cpu":
            raise ValueError("distributed.process_group=nccl needs a GPU; use gloo (or auto) on the CPU")
        _check_device_per_rank(accelerator.type, local_rank, local_world_size)
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
        backend = process_group if process_group != "auto" else dist.get_default_backend_for_device(device)
    group = backend if backend == "gloo" or not host_tensors else f"{device.type}:{backend},cpu:gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=group, rank=rank, world_size=world_size, init_method=init_method)
    objects = None if backend == "gloo" else dist.new_group(backend="gloo")
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device, launch=launch,
                 object_group=objects)


def _check_device_per_rank(kind: str, local_rank: int, local_world_size: int | None) -> None:
    """Each rank of a node takes device ``local_rank``: refuse, naming the fix, when the node has fewer devices than
    ranks (torch would fail later, inside ``set_device``, with "invalid device ordinal" on one rank only)."""
    visible = torch.accelerator.device_count()
    ranks = max(local_rank + 1, local_world_size or 0)
    if ranks > visible:
        raise ValueError(f"{ranks} training ranks on this node but {visible} {kind} device(s) visible: each rank needs "
                         f"its own device; start at most {visible} (torchrun --nproc-per-node {visible}), or run the "
                         "ranks on the CPU (trainer.device=cpu distributed.process_group=gloo)")


def join_from_env(process_group: str = "auto", environ: Mapping[str, str] = os.environ, *,
                  host_tensors: bool = False) -> World:
    """The world torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR/PORT``)."""
    local_world = environ.get("LOCAL_WORLD_SIZE")
    return join(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]), launch="torchrun",
                process_group=process_group, local_world_size=int(local_world) if local_world else None,
                host_tensors=host_tensors)


def join_alone(process_group: str = "auto", *, host_tensors: bool = False) -> World:
    """A process group of this process alone (one-process runs that shard over a world of one rank: FSDP2 needs a
    group), over a free local port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return join(0, 1, 0, launch="single", process_group=process_group, init_method=f"tcp://127.0.0.1:{port}",
                host_tensors=host_tensors)


def leave() -> None:
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


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value gathered to its full tensor; a plain tensor as it is. Collective for DTensors. A
    shard in host memory (``distributed.offload``) goes to its mesh's device first, so the gather runs there."""
    if not hasattr(t, "full_tensor"):
        return t
    on = t.device_mesh.device_type
    if t.to_local().device.type != on:
        t = t.to(on)
    return t.full_tensor()
