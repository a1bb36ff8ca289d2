"""Config: YAML round trip, dotted overrides, and every kind of bad input named by its key."""

from __future__ import annotations

import pytest
import yaml

from mmrlhf.cli import main
from mmrlhf.config import ConfigError, MMRLHFConfig, build_config, dump_config, load_config


def test_defaults_validate_and_are_frozen():
    cfg = load_config(None)
    assert isinstance(cfg, MMRLHFConfig)
    with pytest.raises(Exception):
        cfg.trainer.lr = 1.0  # type: ignore[misc]


def test_yaml_round_trip(tmp_path):
    src = tmp_path / "run.yaml"
    src.write_text(yaml.safe_dump({"trainer": {"lr": 3e-6, "max_steps": 7}, "rollout": {"engine": "transformers",
                                   "stop": ["</answer>"]}}))
    cfg = load_config(src)
    assert (cfg.trainer.lr, cfg.trainer.max_steps, cfg.rollout.engine) == (3e-6, 7, "transformers")
    assert cfg.rollout.stop == ["</answer>"]
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg


def test_overrides_apply_in_order_and_parse_types():
    cfg = build_config({"trainer": {"lr": 1e-3}}, ["trainer.lr=1e-6", "rollout.temperature=0.7",
                                                   "trainer.packing_samples=true", "rollout.stop=[a, b]",
                                                   "trainer.lr=2e-6"])
    assert cfg.trainer.lr == 2e-6
    assert cfg.rollout.temperature == 0.7
    assert cfg.trainer.packing_samples is True
    assert cfg.rollout.stop == ["a", "b"]


def test_overrides_reach_the_fields_of_a_reward_source_of_any_type():
    """``label_map`` maps names to a union of source sections: a dotted override goes into the entry (a judge's
    fields, a remote's url, a judge's engine settings) and validation, not the first union member, checks it."""
    base = {"reward": {"label_map": {"checker": {"type": "remote", "url": "http://127.0.0.1:8000/score"},
                                     "judge": {"type": "judge", "model": "judge", "url": "http://h:1/v1"}}}}
    cfg = build_config(base, ["reward.label_map.checker.url=http://other:9/score",
                              "reward.label_map.judge.backend=vllm", "reward.label_map.judge.model=/models/j",
                              "reward.label_map.judge.engine.gpu_memory_utilization=0.25"])
    judge = cfg.reward.label_map["judge"]
    assert cfg.reward.label_map["checker"].url == "http://other:9/score"
    assert (judge.backend, judge.model, judge.engine) == ("vllm", "/models/j", {"gpu_memory_utilization": 0.25})
    with pytest.raises(ConfigError) as info:  # the key as written, and the judge's own fields
        build_config(base, ["reward.label_map.judge.modle=x"])
    assert "'reward.label_map.judge.modle' (did you mean 'model'?)" in str(info.value)
    assert "chat_template_kwargs" in str(info.value) and "function" not in str(info.value)
    with pytest.raises(ConfigError, match=r"'reward\.label_map\.checker\.max_retries': .*greater than or equal"):
        build_config(base, ["reward.label_map.checker.max_retries=-1"])


@pytest.mark.parametrize(
    "override, must_contain",
    [
        ("trainer.lrr=1e-6", ["trainer.lrr", "did you mean 'lr'", "valid keys"]),
        ("trainr.lr=1e-6", ["trainr", "trainer"]),
        ("rollout.engine=sglang", ["rollout.engine", "'vllm'", "'transformers'"]),
        ("model.dtype=fp8", ["model.dtype", "'bfloat16'"]),
        ("trainer.lr=fast", ["trainer.lr", "number"]),
        ("trainer.lr=-1", ["trainer.lr", "greater than 0"]),
        ("rollout.top_p=1.5", ["rollout.top_p", "less than or equal to 1"]),
        ("trainer.max_steps=2.5", ["trainer.max_steps", "integer"]),
        ("trainer.lr.x=1", ["trainer.lr", "not a section"]),
        ("trainer=5", ["'trainer'"]),
        ("trainer.lr", ["trainer.lr", "key.path=value"]),
        ("=3", ["empty key"]),
        ("distributed.activation_checkpointing=true", ["'distributed.activation_checkpointing' was replaced by "
                                                       "trainer.gradient_checkpointing"]),
    ],
)
def test_bad_overrides_name_the_key(override, must_contain):
    with pytest.raises(ConfigError) as info:
        build_config({}, [override])
    for text in must_contain:
        assert text in str(info.value), (override, str(info.value))


def test_cross_field_validation_names_section():
    with pytest.raises(ConfigError, match="rollout.*min_new_tokens"):
        build_config({}, ["rollout.max_new_tokens=4", "rollout.min_new_tokens=8"])


def test_a_check_across_sections_is_one_plain_line():
    """A rule the whole config's validator checks (keys of two sections) names its keys in its own words: the line
    carries neither an empty key nor pydantic's "Value error" prefix."""
    with pytest.raises(ConfigError) as info:
        build_config({}, ["rollout.partial=true"])
    text = str(info.value)
    assert text.startswith("config: rollout.partial=true needs the asynchronous Ray mode"), text
    assert "''" not in text and "Value error" not in text


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  learning_rate: 1e-6\n")
    with pytest.raises(ConfigError, match="trainer.learning_rate"):
        load_config(unknown)


def test_cli_config_show(tmp_path, capsys):
    src = tmp_path / "run.yaml"
    src.write_text("trainer:\n  lr: 0.001\n")
    assert main(["config", "show", str(src), "rollout.n_samples_per_prompt=4"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["trainer"]["lr"] == 0.001
    assert shown["rollout"]["n_samples_per_prompt"] == 4
    assert set(shown) == set(MMRLHFConfig.model_fields)

    assert main(["config", "show", "trainer.warmup_steps=-3"]) == 2
    assert "trainer.warmup_steps" in capsys.readouterr().err


def test_every_knob_is_documented_and_the_reference_is_current():
    from pathlib import Path

    from mmrlhf.config.reference import missing_descriptions, render_reference

    assert missing_descriptions() == []
    committed = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert committed.read_text() == render_reference(), "regenerate: mmrlhf config docs > docs/configuration.md"


def test_overrides_may_follow_the_options():
    """``mmrlhf train x.yaml --resume trainer.max_steps=200`` keeps the override (argparse alone rejects it);
    anything unknown after the options is still an error."""
    from mmrlhf.cli import build_parser, parse_args

    parser = build_parser()
    args = parse_args(parser, ["train", "x.yaml", "trainer.lr=1e-6", "--resume", "trainer.max_steps=200"])
    assert args.resume and args.overrides == ["trainer.lr=1e-6", "trainer.max_steps=200"]
    with pytest.raises(SystemExit) as exc:
        parse_args(parser, ["train", "x.yaml", "--resume", "--not-an-option"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(parser, ["smoke", "trainer.lr=1"])  # a command without overrides takes none
