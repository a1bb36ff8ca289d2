"""The multi-GPU recipes' headers against the memory plan: the plan command each header shows prints a plan that
fits, every launch the header offers (torchrun's nodes x GPUs, its overrides) fits the GPUs it names, and the
GiB the header quotes are the plan's (so a change to the plan or to the recipe cannot leave the header stale)."""

from __future__ import annotations

import json

import pytest

from mmrlhf.cli import main as cli_main
from mmrlhf.config import load_config
from mmrlhf.models.memory.advice import memory_plan
from mmrlhf.models.memory.plan import GIB
from recipe_testing import RECIPES, ROOT, Recipe, launches, plan_command

# recipes planned over nodes x GPUs: their header's plan command names --ranks and --gpus-per-node
PLANNED = [p for p in RECIPES if "--gpus-per-node" in " ".join(plan_command(Recipe.load(p)) or [])]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_large_model_recipes_are_planned():
    assert {p.name for p in PLANNED} >= {"grpo_geometry3k_qwen2_5_vl_32b.yaml", "grpo_geometry3k_qwen2_5_vl_72b.yaml"}


@pytest.mark.parametrize("path", PLANNED, ids=[p.stem for p in PLANNED])
def test_every_launch_in_the_header_fits_the_gpus_it_names(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = Recipe.load(path)
    argv = plan_command(recipe)
    assert cli_main([*argv, "--json"]) == 0  # the header's own command, as a user runs it
    shown = json.loads(capsys.readouterr().out)
    assert shown["fits"], shown["verdict"]
    shape, gpu = _flag(argv, "--shape"), float(_flag(argv, "--gpu-memory"))
    header = " ".join(recipe.header.replace("#", " ").split())
    runs = launches(recipe)
    assert len(runs) >= 2  # the default launch and at least one alternative
    assert (runs[0][0], runs[0][1]) == (int(_flag(argv, "--ranks")), int(_flag(argv, "--gpus-per-node")))
    for ranks, per_node, overrides in runs:
        config = load_config(str(path.relative_to(ROOT)), overrides)
        assert config.distributed.backend == "torchrun" and ranks > 1
        plan = memory_plan(config, shape=shape, gpu_gib=gpu, ranks=ranks, gpus_per_node=per_node, suggest=False)
        assert plan.launch.fits, (overrides, plan.verdict)
        assert f"{plan.launch.peak / GIB:.1f} GiB" in header, (overrides, plan.launch.peak / GIB)
        if plan.launch.host_per_node:  # the offload's host memory the header quotes, per rank
            assert f"{sum(plan.launch.gpus[0].host.values()) / GIB:.1f} GiB of host memory" in header


@pytest.mark.parametrize("path", PLANNED, ids=[p.stem for p in PLANNED])
def test_control_without_its_keys_the_recipe_does_not_fit_and_the_plan_names_them(path, monkeypatch):
    """Without offload the recipe's own launch does not fit and the plan names distributed.offload=params; without
    tensor parallelism as well the engine cannot start, and every fix the plan offers sets the recipe's size."""
    monkeypatch.chdir(ROOT)
    recipe = Recipe.load(path)
    argv = plan_command(recipe)
    shape, gpu, ranks = _flag(argv, "--shape"), float(_flag(argv, "--gpu-memory")), int(_flag(argv, "--ranks"))
    name = str(path.relative_to(ROOT))
    config = load_config(name)
    assert config.distributed.offload == "params"
    on_gpu = memory_plan(load_config(name, ["distributed.offload=none"]), shape=shape, gpu_gib=gpu, ranks=ranks,
                         gpus_per_node=8)
    assert not on_gpu.launch.fits and ["distributed.offload=params"] in [f.overrides for f in on_gpu.fixes]
    bare = load_config(name, ["distributed.offload=none", "rollout.tensor_parallel_size=1"])
    plan = memory_plan(bare, shape=shape, gpu_gib=gpu, ranks=ranks, gpus_per_node=8)
    assert not plan.launch.fits and any(p.startswith("vLLM cannot start") for p in plan.launch.problems)
    labels = [f.label for f in plan.fixes]
    tp = f"rollout.tensor_parallel_size={config.rollout.tensor_parallel_size}"
    assert labels and all(tp in label for label in labels), labels  # no fix without the engine's
    assert any("distributed.offload=params" in label for label in labels), labels


@pytest.mark.parametrize("path", PLANNED, ids=[p.stem for p in PLANNED])
def test_torchrun_accepts_the_recipe_s_tensor_parallel_engine(path, monkeypatch):
    from mmrlhf.launch.torchrun import check_torchrun_config

    monkeypatch.chdir(ROOT)
    ranks, _, overrides = launches(Recipe.load(path))[0]
    check_torchrun_config(load_config(str(path.relative_to(ROOT)), overrides), ranks)
