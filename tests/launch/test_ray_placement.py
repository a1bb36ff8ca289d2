"""Where the Ray mode's actors go, without a cluster: one placement-group bundle per actor; on a GPU cluster each
rollout actor owns ``rollout.tensor_parallel_size`` GPUs and each trainer actor one by default (Ray then gives each
actor its own CUDA_VISIBLE_DEVICES instead of leaving all of them on GPU 0); settings that cannot work are refused by
key."""

from __future__ import annotations

import pytest

from mmrlhf.config.distributed import DistributedConfig
from mmrlhf.launch.ray.runtime import plan_placement
from mmrlhf.parallel.ray_actors import actor_options


def _d(**kw) -> DistributedConfig:
    return DistributedConfig(backend="ray", **kw)


def test_cpu_cluster_reserves_no_gpu():
    plan = plan_placement(_d(num_rollout_actors=2), tensor_parallel_size=1, cluster_gpus=0)
    assert plan.bundles() == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert [s.bundle_index for s in plan.rollout] == [0, 1] and plan.trainer[0].bundle_index == 2


def test_gpu_cluster_gives_every_actor_its_own_gpus():
    plan = plan_placement(_d(num_rollout_actors=3), tensor_parallel_size=2, cluster_gpus=8)
    assert plan.bundles() == [{"CPU": 1.0, "GPU": 2.0}] * 3 + [{"CPU": 1.0, "GPU": 1.0}]
    assert plan.gpus == 7
    options = actor_options("holder", plan.rollout[1].cpus, plan.rollout[1].gpus)
    assert options["num_gpus"] == 2.0
    one = plan_placement(_d(num_rollout_actors=4), tensor_parallel_size=1, cluster_gpus=8)
    assert [s.gpus for s in (*one.rollout, *one.trainer)] == [1.0] * 5


@pytest.mark.parametrize("kw, tp, gpus, key", [
    ({"rollout_actor_gpus": 0}, 1, 8, "distributed.rollout_actor_gpus=0"),
    ({"trainer_actor_gpus": 0}, 1, 8, "distributed.trainer_actor_gpus=0"),
    ({"rollout_actor_gpus": 1}, 2, 8, "rollout.tensor_parallel_size=2"),
    ({"num_rollout_actors": 4}, 2, 8, "need 9 GPUs"),
    ({"trainer_actor_gpus": 1}, 1, 0, "has no GPUs"),
])
def test_placement_that_cannot_work_is_refused_by_key(kw, tp, gpus, key):
    with pytest.raises(ValueError, match=key):
        plan_placement(_d(**kw), tensor_parallel_size=tp, cluster_gpus=gpus)


def test_fractions_share_a_gpu_when_asked():
    plan = plan_placement(_d(rollout_actor_gpus=0.5, trainer_actor_gpus=0.5), tensor_parallel_size=1, cluster_gpus=1)
    assert plan.bundles() == [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]
