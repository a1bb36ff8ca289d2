"""``trainer.max_tokens_per_micro_batch`` and ``rollout.max_tokens_per_micro_batch``: parsed and checked by key,
``auto`` by default, plumbed into the update and experience settings, and kept off where the loss depends on the
split (``seq-mean-token-sum-norm`` without ``algorithm.loss_agg_norm_len``)."""

from __future__ import annotations

import pytest

from mmrlhf.config import build_config
from mmrlhf.config.loader import ConfigError
from mmrlhf.experience.settings import experience_settings
from mmrlhf.trainer.builder import policy_update_settings, update_token_budget


@pytest.mark.parametrize("value,expected", [("8192", 8192), ("null", None), ("auto", "auto")])
def test_values_parse(value, expected):
    config = build_config({}, [f"trainer.max_tokens_per_micro_batch={value}",
                               f"rollout.max_tokens_per_micro_batch={value}"])
    assert config.trainer.max_tokens_per_micro_batch == expected
    assert config.rollout.max_tokens_per_micro_batch == expected
    assert policy_update_settings(config, "none").max_tokens_per_micro_batch == expected
    settings = experience_settings(config.algorithm, config.rollout, config.trainer)
    assert settings.max_tokens_per_micro_batch == expected


def test_defaults_are_auto():
    config = build_config({})
    assert config.trainer.max_tokens_per_micro_batch == config.rollout.max_tokens_per_micro_batch == "auto"
    assert update_token_budget(config) == "auto"


@pytest.mark.parametrize("override", ["trainer.max_tokens_per_micro_batch=0", "rollout.max_tokens_per_micro_batch=-5",
                                      "trainer.max_tokens_per_micro_batch=lots"])
def test_bad_values_name_the_key(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        build_config({}, [override])


def test_a_loss_normalised_per_micro_batch_keeps_the_count_split():
    norm = ["algorithm.loss_agg=seq-mean-token-sum-norm"]
    assert update_token_budget(build_config({}, norm)) is None  # auto: off where the split changes the loss
    assert update_token_budget(build_config({}, norm + ["algorithm.loss_agg_norm_len=512"])) == "auto"
    off = build_config({}, norm + ["trainer.max_tokens_per_micro_batch=null"])
    assert off.trainer.max_tokens_per_micro_batch is None
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_micro_batch=4096.*algorithm.loss_agg_norm_len"):
        build_config({}, norm + ["trainer.max_tokens_per_micro_batch=4096"])
    ok = build_config({}, norm + ["trainer.max_tokens_per_micro_batch=4096", "algorithm.loss_agg_norm_len=512"])
    assert update_token_budget(ok) == 4096
