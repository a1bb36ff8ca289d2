"""The ``algorithm`` config section agrees with the algorithms it configures."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from mmrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS
from mmrlhf.algorithms.kl import KL_ESTIMATORS
from mmrlhf.algorithms.losses import POLICY_LOSSES
from mmrlhf.algorithms.masked import AGG_MODES
from mmrlhf.config.algorithm import AlgorithmConfig


def _choices(field):
    return set(typing.get_args(AlgorithmConfig.model_fields[field].annotation))


def test_every_field_is_documented():
    for name, field in AlgorithmConfig.model_fields.items():
        assert field.description, f"algorithm.{name} has no docstring"


def test_choices_match_the_implementation():
    assert _choices("loss_agg") == set(AGG_MODES)
    assert _choices("kl_estimator") == _choices("kl_loss_estimator") == set(KL_ESTIMATORS)
    cfg = AlgorithmConfig()
    assert cfg.advantage_estimator in ADVANTAGE_ESTIMATORS
    assert cfg.policy_loss in POLICY_LOSSES


@pytest.mark.parametrize(
    "bad",
    [
        {"clip_low": -0.1},
        {"loss_agg": "token-sum"},
        {"kl_estimator": "k4"},
        {"dual_clip": 1.0},
        {"high_entropy_top_p": 0.0},
        {"kl_controller": "adaptive", "kl_reward_coef": 0.0},
        {"unknown_field": 1},
    ],
)
def test_invalid_values_rejected(bad):
    with pytest.raises(ValidationError):
        AlgorithmConfig(**bad)
