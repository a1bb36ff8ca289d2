"""The shipped examples stay valid: the YAML recipe validates, and the custom reward runs through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmrlhf.config import build_config, load_config
from mmrlhf.rewards import RewardBatch, RewardComputationEngine

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_YAML = ROOT / "examples" / "rewards" / "reward_config.yaml"


def test_example_config_validates():
    reward = load_config(EXAMPLE_YAML).reward
    assert reward.label_map["judge"].type == "remote"
    assert reward.recipe["math"] == [("format", 0.1), ("accuracy", 0.9)]


def test_example_custom_reward_through_the_engine(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example names its plugin by a repo-relative path
    data = yaml.safe_load(EXAMPLE_YAML.read_text())
    del data["reward"]["label_map"]["judge"]
    del data["reward"]["recipe"]["chart"]
    engine = RewardComputationEngine.from_config(build_config(data).reward)
    batch = RewardBatch(
        responses=["<think>t</think><answer>4</answer>", "four " * 20, "<think>t</think><answer>(A)</answer>", "x"],
        prompts=["<think>"] * 4,
        labels=["geometry", "geometry", "mcq", "unlisted"],
        references=["4", "4", "A", None],
        extra={"max_words": [10, 10, 10, 10]},
    )
    result = engine.compute(batch)
    assert result.rewards.tolist() == pytest.approx([1.0, -0.5, 1.0, 0.0])
    assert result.parts["custom/too_long"].tolist()[:2] == [0.0, 1.0]
    assert result.metrics["reward/custom/accuracy/mean"] == pytest.approx(0.5)
    assert result.valid.tolist() == [True, True, True, True]  # the default recipe scored the unlisted label
