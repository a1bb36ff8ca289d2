"""The shipped recipes: each validates (`mmrlhf config show`), its header says how to prepare its data and how to
launch it, and a tiny override of it (tiny model of its family, synthetic data prepared by its own command) trains
2 steps through the real trainer with every reward source of its recipe scoring."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from mmrlhf.cli import main as cli_main
from mmrlhf.config import load_config
from mmrlhf.data.datasets import PromptDataset
from mmrlhf.data.prepare import CONVERTERS
from mmrlhf.testing.tiny_models import tiny_model_dir
from recipe_testing import (RECIPES, ROOT, Recipe, judge_sources, prepare_synthetic, remote_sources,
                            server_command, tiny_config, tiny_judge_fields, train_commands)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewards"))  # the reward tests' server helper
from reward_testing import ServerProcess  # noqa: E402
from judge_testing import build_keyword_judge  # noqa: E402

IDS = [p.stem for p in RECIPES]


def test_the_recipes_cover_the_families_estimators_and_inputs_promised():
    recipes = [Recipe.load(p) for p in RECIPES]
    assert {r.family for r in recipes} == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe"}
    assert {r.data["algorithm"]["advantage_estimator"] for r in recipes} == {"grpo", "gae"}
    converters = {r.prepare_commands()[0][0] for r in recipes}
    assert converters == set(CONVERTERS)  # every converter is used by a recipe, and only known ones are named
    assert any(remote_sources(r) for r in recipes)
    assert any(judge_sources(r) for r in recipes)


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_recipe_passes_config_show_and_round_trips(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli_main(["config", "show", str(path.relative_to(ROOT))]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == load_config(path).model_dump(mode="json")
    assert shown["model"]["dtype"] == "bfloat16" and shown["model"]["attn_implementation"] == "sdpa"
    assert shown["rollout"]["engine"] == "vllm" and not shown["rollout"]["enforce_eager"]  # GPU settings


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_recipe_header_names_its_launch_and_preparation_commands(path):
    recipe = Recipe.load(path)
    assert f"mmrlhf train examples/{path.name}" in recipe.header
    commands = recipe.prepare_commands()
    assert commands, f"{path.name}: no 'python -m mmrlhf.data.prepare' command in the header"
    from mmrlhf.data.prepare.__main__ import build_parser

    prepared = set()
    for argv in commands:
        args = build_parser().parse_args(argv)  # each command is valid for the CLI as written
        prepared.add(args.output)
    assert set(recipe.data["data"]["prompt_data"]) <= prepared  # the recipe reads what the header writes


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_recipe_header_train_commands_validate_with_their_overrides(path, monkeypatch):
    """Every launch the header offers (the alternatives' overrides included) is a valid config."""
    monkeypatch.chdir(ROOT)
    commands = train_commands(Recipe.load(path))
    assert commands
    for argv in commands:
        assert argv[0] == f"examples/{path.name}", argv
        load_config(argv[0], [a for a in argv[1:] if "=" in a and not a.startswith("-")])


def test_every_recipe_is_listed_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    for path in RECIPES:
        assert f"examples/{path.name}" in section, path.name


def _reward_sources(config, labels):
    recipes = config.reward.recipe
    return {name for label in labels for name, weight in recipes.get(label, config.reward.default_recipe or [])
            if weight}


@pytest.fixture
def one_torch_thread():
    """Tiny models' matrices are too small to split; on a loaded 2-core machine a second OpenMP thread only waits
    for the first (measured: one tiny 2-step run, load average 11, took 29 s with 2 threads and 6 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("path", RECIPES, ids=IDS)
def test_tiny_override_of_the_recipe_trains_two_steps(path, tmp_path, one_torch_thread):
    from mmrlhf.trainer.builder import build_trainer

    recipe = Recipe.load(path)
    data_file = prepare_synthetic(recipe, tmp_path)
    servers, urls = [], {}
    try:
        for name in remote_sources(recipe):
            argv = server_command(recipe)
            token = tmp_path / "token.txt"
            token.write_text("recipe-test-token")
            argv[argv.index("--port") + 1] = "0"
            argv[argv.index("--token-file") + 1] = str(token)
            server = ServerProcess([sys.executable, "-m", "mmrlhf.cli.serve_reward", *argv])
            servers.append(server)
            urls[name] = {"url": server.url, "token_file": str(token)}
        for name in judge_sources(recipe):  # in process, on a tiny judge (what the header's server would serve)
            judge = build_keyword_judge(tiny_model_dir("qwen2_vl"), tmp_path / f"judge-{name}", good="red",
                                        bad="blue", gain=2.0)
            urls[name] = tiny_judge_fields(judge)
        config = tiny_config(recipe, data_file, tmp_path / "run", **urls)
        trainer = build_trainer(config)
        with trainer.p.tracker:
            trainer.fit()
    finally:
        for server in servers:
            server.stop()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["reward/mean"]) for r in rows)
    labels = {r.label for r in PromptDataset(str(data_file), config.data)}
    for source in _reward_sources(config, labels):  # the prepared labels reach every source of their recipe
        assert rows[0][f"reward/{source}/count"] > 0, (source, sorted(k for k in rows[0] if k.startswith("reward/")))
