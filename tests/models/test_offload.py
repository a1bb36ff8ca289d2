"""``distributed.offload`` without a run: the key's policy, its refusal, and the process group it asks for.

The run itself (one process sharding over a world of one rank with FSDP2's CPU offload, the first step against the
plain process's, the host bytes against the memory plan) is in ``tests/launch/test_torchrun.py``; the plan's host
rows in ``tests/models/test_memory_plan.py``."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.config import load_config
from mmrlhf.models.sharding import offload_policy

TOY = "examples/grpo_toy_shapes_cpu.yaml"


def test_params_is_fsdp2s_cpu_offload_pinned_only_beside_an_accelerator():
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert offload_policy("none", torch.device("cpu")) is None
    on_cpu, on_gpu = offload_policy("params", torch.device("cpu")), offload_policy("params", torch.device("cuda", 0))
    assert isinstance(on_cpu, CPUOffloadPolicy) and not on_cpu.pin_memory  # pinning needs an accelerator
    assert isinstance(on_gpu, CPUOffloadPolicy) and on_gpu.pin_memory
    with pytest.raises(ValueError, match="distributed.offload"):
        offload_policy("optimizer", torch.device("cpu"))


def test_the_transformers_engine_is_refused_by_key_and_vllm_is_not():
    assert load_config(TOY, ["distributed.offload=params"]).distributed.offload == "params"
    with pytest.raises(ValueError, match=r"distributed\.offload=params with rollout\.engine=transformers"):
        load_config(TOY, ["distributed.offload=params", "rollout.engine=transformers"])
    with pytest.raises(ValueError, match="distributed.offload"):
        load_config(TOY, ["distributed.offload=everything"])


def test_an_accelerator_group_routes_host_tensors_to_gloo(monkeypatch):
    """With offload the gradient norm and the gathers run on host-memory shards: the group must take CPU tensors."""
    import torch.distributed as dist

    from mmrlhf.parallel import world

    made = {}
    monkeypatch.setattr(world, "_check_device_per_rank", lambda *a: None)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.update(backend=backend))
    monkeypatch.setattr(dist, "new_group", lambda backend: f"group:{backend}")
    monkeypatch.setattr("mmrlhf.devices.resolve_device", lambda _: torch.device("cuda", 0))
    monkeypatch.setattr(dist, "get_default_backend_for_device", lambda d: "nccl")
    got = world.join(0, 2, 0, launch="torchrun", host_tensors=True)
    assert made["backend"] == "cuda:nccl,cpu:gloo" and got.object_group == "group:gloo"
    world.join(0, 2, 0, launch="torchrun")  # control: no offload, no host route
    assert made["backend"] == "nccl"
    world.join(0, 2, 0, launch="torchrun", process_group="gloo", host_tensors=True)
    assert made["backend"] == "gloo"
