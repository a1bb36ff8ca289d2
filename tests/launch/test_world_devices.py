"""A node with fewer accelerators than training ranks is refused before any rank touches a device, with the fix
(``--nproc-per-node``) and the number of devices visible in the message. Without the check, torch fails on the rank
whose device is missing, inside ``set_device``, with "invalid device ordinal" (seen with 2 ranks on one GPU).

The accelerator is faked (``torch.accelerator.device_count``, the device ``auto`` resolves to), so this runs on the
CPU; the process group is never made (a rank that got that far would show in ``made``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mmrlhf.devices
from mmrlhf.parallel.world import join, join_from_env


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: pretend torch sees ``n`` CUDA devices; returns the record of set_device / group creation."""
    made: list = []
    monkeypatch.setattr(mmrlhf.devices, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: made.append(("set_device", i)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: made.append(("group", kw["backend"])))
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(("objects", kw["backend"])))

    def visible(n: int) -> list:
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: n)
        return made

    return visible


@pytest.mark.parametrize("local_rank", [0, 1])
def test_two_ranks_on_one_gpu_are_refused_on_every_rank(gpus, local_rank):
    made = gpus(1)
    env = {"RANK": str(local_rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match=r"2 training ranks on this node but 1 cuda device\(s\) visible.*"
                                         r"torchrun --nproc-per-node 1"):
        join_from_env("auto", env)
    assert made == []  # refused before any rank set a device or joined a group


def test_a_rank_beyond_the_devices_is_refused_without_the_node_size(gpus):
    made = gpus(2)
    with pytest.raises(ValueError, match="3 training ranks on this node but 2 cuda"):
        join(2, 3, 2, launch="ray", process_group="nccl")
    assert made == []


def test_one_device_per_rank_passes(gpus):
    """The control: as many devices as ranks, and each rank gets its own."""
    made = gpus(2)
    world = join_from_env("auto", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert world.device == torch.device("cuda", 1) and world.rank == 1
    assert made == [("set_device", 1), ("group", "nccl"), ("objects", "gloo")]
