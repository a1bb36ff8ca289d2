"""The Ray mode over two nodes, on one machine, and across trainer actor counts.

A Ray cluster of two nodes (``ray.cluster_utils.Cluster``: a head and a worker, each a raylet of its own with its
own CPUs and a custom resource): the rollout actor asks for the head's resource (``distributed.
rollout_actor_resources``), the trainer actors for the worker's (``distributed.trainer_actor_resources``), and each
actor reports the node it runs on. The runs train the greedy toy recipe (``launch_testing.GREEDY_TOY``):

- ``one_node``: 1 rollout actor + 1 trainer actor, no resources asked for: both fit the head and go there together
  (the placement group packs); 3 steps, a checkpoint after each. The single-node reference.
- ``one_to_two``: ``one_node``'s step-1 checkpoint resumed by 2 trainer actors on the worker node (the rollout actor
  on the head): steps 2 and 3 continue the straight run within fp32 reduction noise (a checkpoint of 1 rank resumed
  on 2: the data stream, the optimiser state re-sharded by torch.distributed.checkpoint, the running counters).
- ``two_to_one``: ``one_to_two``'s step-2 checkpoint (written by 2 trainer actors) resumed by 1 trainer actor, back
  on the head: step 3 continues the straight run (a checkpoint of 2 ranks resumed on 1).

In the Ray mode the rollout actor generates every step's experiences whatever the number of trainer actors (seeded
by (step, actor)), so the continued runs train what the straight run trained; greedy decoding is not needed for that
(it is for torchrun ranks, tests/launch/test_rank_changes.py) and is used here only so both files share one recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ray  # noqa: E402  (requirements/project.txt installs it; a missing ray must fail, not skip)

from launch_testing import GREEDY_TOY, GREEDY_TOY_LR, REDUCTION_NOISE_KEYS, checkpoint_weights, metric_rows, \
    stopped_at, training_gaps, update_gap

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT_NODE, TRAINER_NODE = "mmrlhf_test_rollout_node", "mmrlhf_test_trainer_node"
PLACED = (f"distributed.rollout_actor_resources={{{ROLLOUT_NODE}: 1}}",
          f"distributed.trainer_actor_resources={{{TRAINER_NODE}: 1}}")
STEPS = 3


def _config(out: Path, *overrides: str):
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}", f"trainer.output_dir={out}",
        f"trainer.max_steps={STEPS}", "distributed.backend=ray", *GREEDY_TOY, *overrides])


@pytest.fixture(scope="module")
def two_nodes():
    """{resource name -> node id} of a two-node Ray cluster on this machine, connected."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {ROLLOUT_NODE: 1},
                                                           "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={TRAINER_NODE: 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        nodes = {name: node["NodeID"] for node in ray.nodes() if node["Alive"] for name in node["Resources"]
                 if name in (ROLLOUT_NODE, TRAINER_NODE)}
        assert len(set(nodes.values())) == 2, nodes
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


# Run inside an actor by ``__ray_call__`` (which passes the actor itself): a lambda, which Ray pickles by value (a
# function of this module would be looked up by name in the actor's process, where the test module is not importable).
_NODE_OF = lambda actor: __import__("ray").get_runtime_context().get_node_id()  # noqa: E731


def _ray(out: Path, *overrides: str, resume: bool = False) -> dict:
    """A Ray run of the greedy toy recipe; the node ids its actors reported at its first step."""
    from mmrlhf.launch.ray.driver import run_ray

    placed: dict = {}

    def on_step(run, step: int) -> None:
        if not placed:
            placed["rollout"] = ray.get([h.__ray_call__.remote(_NODE_OF) for h in run.pool.handles])
            placed["trainer"] = ray.get([r.__ray_call__.remote(_NODE_OF) for r in run.ranks])

    assert run_ray(_config(out, *overrides), resume=resume, on_step=on_step) == 0
    return {"out": out, **placed}


@pytest.fixture(scope="module")
def runs(two_nodes, tmp_path_factory):
    one = _ray(tmp_path_factory.mktemp("one_node"))
    two = _ray(stopped_at(one["out"], tmp_path_factory.mktemp("one_to_two"), 1), *PLACED,
               "distributed.num_trainer_actors=2", "distributed.trainer_actor_cpus=0.5", resume=True)
    back = _ray(stopped_at(two["out"], tmp_path_factory.mktemp("two_to_one"), 2), resume=True)
    return {"one_node": one, "one_to_two": two, "two_to_one": back}


def _initial() -> dict:
    from safetensors.torch import load_file

    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_file(str(next(Path(tiny_model_dir("qwen2_vl", "tiny", 0)).glob("*.safetensors"))))


@pytest.mark.slow
@pytest.mark.vllm
def test_actors_go_to_the_nodes_their_resources_name(runs, two_nodes):
    one, two = runs["one_node"], runs["one_to_two"]
    assert len({*one["rollout"], *one["trainer"]}) == 1  # nothing asked for: packed onto one node
    assert two["rollout"] == [two_nodes[ROLLOUT_NODE]]
    assert two["trainer"] == [two_nodes[TRAINER_NODE]] * 2


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_resumed_on_two_trainer_actors_and_two_nodes_continues_the_one_node_run(runs):
    """1 trainer actor -> 2 (steps 2, 3), on two nodes: every training metric the straight one-node run's (the sums
    over 2 ranks within reduction noise), and the weights' updates within a small fraction of the learning rate."""
    straight, out, since = metric_rows(runs["one_node"]["out"]), runs["one_to_two"]["out"], 1
    assert [r["step"] for r in straight] == [1, 2, 3]
    rewards = [r["reward/mean"] for r in straight]
    assert len(set(rewards)) == STEPS, rewards  # every step reads other prompts: a stream read again would show
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    gaps = training_gaps(straight[since:], rows[since:])
    assert {"reward/mean", "policy/grad_norm", "policy/entropy", "policy/kl_loss", "samples"} <= set(gaps)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:4]
    print(f"\n1 -> 2 trainer actors: largest metric gaps {worst}")
    assert {k for k, v in gaps.items() if v > 1e-5} <= REDUCTION_NOISE_KEYS and worst[0][1] <= 1e-4, worst
    gap = update_gap(runs["one_node"]["out"], out, STEPS, _initial())
    # the control: over the same steps the straight run's weights moved by far more than that gap
    moved = _moved(runs["one_node"]["out"], since)
    print(f"1 -> 2 trainer actors: update gap at step {STEPS} {gap:.2e} lr; the straight run moved {moved:.2f} lr "
          f"since step {since}")
    assert gap < 0.05 and moved > 0.5, (gap, moved)
    for step, ranks in ((since, 1), (STEPS, 2)):  # who wrote the checkpoint resumed, and the resumed run's
        state = json.loads((out / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").read_text())
        assert (state["launch"], state["world_size"]) == ("ray", ranks)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_checkpoint_of_two_trainer_actors_resumes_on_one(runs):
    """2 trainer actors -> 1 (step 3), from the 2-actor run's step-2 checkpoint: the straight one-node run's metrics
    (within reduction noise) and weights (within a small fraction of the learning rate)."""
    straight, out, since = metric_rows(runs["one_node"]["out"]), runs["two_to_one"]["out"], 2
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    gaps = training_gaps(straight[since:], rows[since:])
    assert {"reward/mean", "policy/grad_norm", "policy/entropy", "samples"} <= set(gaps)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:4]
    gap = update_gap(runs["one_node"]["out"], out, STEPS, _initial())
    moved = _moved(runs["one_node"]["out"], since)
    print(f"\n2 -> 1 trainer actors: largest metric gaps {worst}; update gap at step {STEPS} {gap:.2e} lr; the "
          f"straight run moved {moved:.2f} lr since step {since}")
    assert {k for k, v in gaps.items() if v > 1e-5} <= REDUCTION_NOISE_KEYS and worst[0][1] <= 1e-4, worst
    assert gap < 0.05 and moved > 0.2, (gap, moved)
    for step, ranks in ((since, 2), (STEPS, 1)):
        state = json.loads((out / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").read_text())
        assert (state["launch"], state["world_size"]) == ("ray", ranks)


def _moved(out: Path, since: int) -> float:
    """The largest change of a weight from step ``since`` to the last step, in units of the learning rate."""
    a, b = checkpoint_weights(out, STEPS), checkpoint_weights(out, since)
    return max(float((a[k] - b[k]).abs().max()) for k in a) / GREEDY_TOY_LR


def test_custom_resources_go_into_every_actors_bundle():
    from mmrlhf.config.distributed import DistributedConfig
    from mmrlhf.launch.ray.runtime import check_custom_resources, plan_placement

    d = DistributedConfig(backend="ray", num_trainer_actors=2, rollout_actor_resources={"a": 1},
                          trainer_actor_resources={"b": 1, "a": 0.5})
    plan = plan_placement(d, tensor_parallel_size=1, cluster_gpus=0)
    assert plan.bundles() == [{"CPU": 1.0, "a": 1.0}, {"CPU": 1.0, "a": 0.5, "b": 1.0},
                              {"CPU": 1.0, "a": 0.5, "b": 1.0}]
    assert plan.custom_resources() == {"a": 2.0, "b": 2.0}
    check_custom_resources(d, plan, {"CPU": 3.0, "a": 2.0, "b": 2.0})
    with pytest.raises(ValueError, match=r"2 of the Ray resource 'a' \(distributed.rollout_actor_resources.a=1 x 1 "
                                         r"\+ distributed.trainer_actor_resources.a=0.5 x 2\) but the cluster has 1.5"):
        check_custom_resources(d, plan, {"CPU": 3.0, "a": 1.5, "b": 2.0})


@pytest.mark.parametrize("resources, message", [
    ({"CPU": 1}, "set distributed.rollout_actor_cpus instead"),
    ({"GPU": 1}, "set distributed.rollout_actor_gpus instead"),
    ({"node_a": 0}, r"rollout_actor_resources.node_a=0: an amount must be > 0"),
])
def test_resources_that_are_not_custom_or_not_positive_are_refused_by_key(resources, message):
    from mmrlhf.config.distributed import DistributedConfig

    with pytest.raises(ValueError, match=message):
        DistributedConfig(backend="ray", rollout_actor_resources=resources)


@pytest.mark.slow
def test_a_resource_the_cluster_lacks_is_refused_before_any_actor_starts(two_nodes, tmp_path, capsys):
    from mmrlhf.launch.ray.driver import run_ray

    config = _config(tmp_path, f"distributed.trainer_actor_resources={{{TRAINER_NODE}: 3}}")
    assert run_ray(config) == 2
    err = capsys.readouterr().err
    assert (f"error: the actors ask for 3 of the Ray resource '{TRAINER_NODE}' (distributed.trainer_actor_resources."
            f"{TRAINER_NODE}=3 x 1) but the cluster has 2") in err, err
    # refused before the placement group: every group the cluster ever had (the module's runs') is removed
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())



def test_custom_resources_on_a_ray_of_its_own_are_refused_with_the_way_to_a_cluster():
    """Without ``distributed.ray_address`` / ``RAY_ADDRESS`` the driver starts a Ray of its own, which holds no
    custom resource: the refusal says how to join the cluster that has them (and only then)."""
    from mmrlhf.config.distributed import DistributedConfig
    from mmrlhf.launch.ray.driver import placement_error
    from mmrlhf.launch.ray.runtime import check_custom_resources, plan_placement

    d = DistributedConfig(backend="ray", rollout_actor_resources={"rollout_node": 1})
    with pytest.raises(ValueError) as refused:
        check_custom_resources(d, plan_placement(d, 1, 0), {"CPU": 2.0})
    own = placement_error(refused.value, own_ray=True)
    assert own.startswith("error: the actors ask for 1 of the Ray resource 'rollout_node'") and \
        "set distributed.ray_address or RAY_ADDRESS" in own
    assert "ray_address" not in placement_error(refused.value, own_ray=False)
    assert "ray_address" not in placement_error(ValueError("need 9 GPUs"), own_ray=True)
