"""``algorithm.reward_combination``: the reward engine keeps each sample's recipe weights, the shaping and dynamic
sampling's group filter train on the per-component reward, evaluation's raw reward stays as the engine made it."""

from __future__ import annotations

import dataclasses
import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from mmrlhf.algorithms.dynamic_sampling import filter_groups
from mmrlhf.config import ConfigError, build_config
from mmrlhf.experience.rollout import Rollout, ScoredRollout
from mmrlhf.experience.settings import ExperienceSettings, experience_settings
from mmrlhf.experience.step_shaping import combined_rewards, shape_step
from mmrlhf.parallel.world import single
from mmrlhf.rewards import RewardBatch, RewardComputationEngine, SourceScores
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.trainer.rollouts import group_rewards

NAN = float("nan")


class Table:
    """A source that looks each response up in a table: a float, None ("does not apply") or "fail" (an error)."""

    def __init__(self, table):
        self.table = table

    async def score(self, batch: RewardBatch) -> SourceScores:
        got = [self.table[r] for r in batch.responses]
        return SourceScores(scores=[None if v in (None, "fail") else v for v in got],
                            errors=["broken" if v == "fail" else None for v in got])


# Two groups of four. Group 0 (label "math"): correctness 0/1 x 1 and a quality score in [0, 10] x 0.5, whose spread
# drowns correctness when summed. Group 1: sample "g" fails its quality check (masked under on_failure: mask) and
# "h" is labelled "plain" (correctness x 2 only).
ACC = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 1.0, "f": 0.0, "g": 1.0, "h": 0.0}
QUALITY = {"a": 2.0, "b": 9.0, "c": 3.0, "d": 8.0, "e": 4.0, "f": 6.0, "g": "fail", "h": None}
LABELS = ["math"] * 7 + ["plain"]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def _result():
    engine = RewardComputationEngine({"acc": Table(ACC), "quality": Table(QUALITY)},
                                     {"math": [("acc", 1.0), ("quality", 0.5)], "plain": [("acc", 2.0)]},
                                     on_failure="mask")
    responses = list("abcdefgh")
    return engine.compute(RewardBatch(responses=responses, prompts=[""] * 8, labels=LABELS, references=[None] * 8))


def test_the_engine_keeps_each_samples_recipe_weights():
    r = _result()
    assert r.weights["acc"].tolist() == [1.0] * 7 + [2.0]
    assert r.weights["quality"].tolist() == [0.5] * 7 + [0.0]
    assert r.valid.tolist() == [True] * 6 + [False, True]


def _want_per_component():
    """Written out. Group 0: acc z = +-0.5 / sqrt(1/3); quality mean 5.5, std sqrt(37/3). Group 1 (valid: e, f, h):
    acc over [1, 0, 0] (mean 1/3, std sqrt(1/3)); quality over e, f only ([4, 6]: z = -+1/sqrt(2)), h has none;
    h weighs acc by 2. g is masked: 0."""
    eps = 1e-6
    za = 0.5 / (math.sqrt(1 / 3) + eps)
    qs = math.sqrt(37 / 3) + eps
    group0 = [za - 0.5 * 3.5 / qs, -za + 0.5 * 3.5 / qs, za - 0.5 * 2.5 / qs, -za + 0.5 * 2.5 / qs]
    s1 = math.sqrt(1 / 3) + eps
    zq = 1.0 / (math.sqrt(2.0) + eps)
    group1 = [(2 / 3) / s1 - 0.5 * zq, (-1 / 3) / s1 + 0.5 * zq, 0.0, 2 * (-1 / 3) / s1]
    return group0 + group1


def test_combined_rewards_sum_is_the_engines_and_per_component_is_the_definition():
    r = _result()
    groups = torch.tensor(GROUPS)
    assert torch.equal(combined_rewards(r, groups), r.rewards.float())
    got = combined_rewards(r, groups, combination="per_component")
    torch.testing.assert_close(got, torch.tensor(_want_per_component(), dtype=torch.float32))
    assert r.rewards[:4].tolist() == [2.0, 4.5, 2.5, 4.0]  # the raw reward (evaluation's) is untouched
    with pytest.raises(ValueError, match="recipe weights"):
        combined_rewards(SimpleNamespace(rewards=r.rewards, valid=r.valid, sources=r.sources, weights={}), groups,
                         combination="per_component")
    with pytest.raises(ValueError, match="'sum' or 'per_component'"):
        combined_rewards(r, groups, combination="mean")


def test_the_shaping_trains_on_the_per_component_reward():
    r = _result()

    def shape(combination):
        settings = ExperienceSettings(n_samples_per_prompt=4, reward_combination=combination)
        return shape_step(settings, groups=GROUPS, rewards=r, lengths=torch.full((8,), 2), max_new_tokens=2,
                          mask=torch.ones(8, 2, dtype=torch.bool), log_probs=torch.zeros(8, 2), ref_log_probs=None,
                          values=None, reward_norm=None, kl_controller=None, world=single())

    summed, per_comp = shape("sum"), shape("per_component")
    torch.testing.assert_close(per_comp["seq_reward"], torch.tensor(_want_per_component(), dtype=torch.float32))
    right = torch.tensor([True, False, True, False])
    assert (summed["advantages"][:4, 0][right] < 0).all()  # summed: quality's spread outranks correctness
    assert (per_comp["advantages"][:4, 0][right] > 0).all()  # per component: the right answers are reinforced
    assert not per_comp["mask"][6].any() and per_comp["advantages"][6].eq(0).all()  # the failed sample trains nothing


def _z(values, eps=1e-6):
    """Z-scores within one group, written out (unbiased std; 0 for a constant group)."""
    if max(values) == min(values):
        return [0.0] * len(values)
    mean, std = statistics.fmean(values), statistics.stdev(values) + eps
    return [(v - mean) / std for v in values]


def test_the_overlong_penalty_and_the_tool_bonus_are_components_too():
    """Under ``per_component`` the trainer's own terms are z-scored in their group like the recipe's, each weighted by
    its size (the penalty's factor 1, the bonus 0.2); under ``sum`` they are added as they are. Lengths 2..8 against
    8 new tokens with a buffer of 4: penalties 0, -0.5, -1, 0 | -0.25, -0.25, (g: masked), -1."""
    r = _result()
    lengths = torch.tensor([2, 6, 8, 4, 5, 5, 7, 8])
    bonus = torch.tensor([0.2, 0.0, 0.2, 0.0, 0.2, 0.0, 0.0, 0.0])

    def shape(combination):
        settings = ExperienceSettings(n_samples_per_prompt=4, reward_combination=combination, overlong_buffer_len=4,
                                      overlong_penalty_factor=1.0)
        return shape_step(settings, groups=GROUPS, rewards=r, lengths=lengths, max_new_tokens=8,
                          mask=torch.ones(8, 2, dtype=torch.bool), log_probs=torch.zeros(8, 2), ref_log_probs=None,
                          values=None, reward_norm=None, kl_controller=None, world=single(), bonus=bonus)

    pen = [0.0, -0.5, -1.0, 0.0, -0.25, -0.25, -0.75, -1.0]
    valid1 = [4, 5, 7]  # g (6) is masked: alone in its group, reward 0
    z_pen = _z(pen[:4]) + [0.0] * 4
    z_bonus = _z(bonus[:4].tolist()) + [0.0] * 4
    for i, zp, zb in zip(valid1, _z([pen[i] for i in valid1]), _z([float(bonus[i]) for i in valid1])):
        z_pen[i], z_bonus[i] = zp, zb
    want = [w + 1.0 * p + 0.2 * b for w, p, b in zip(_want_per_component(), z_pen, z_bonus)]
    torch.testing.assert_close(shape("per_component")["seq_reward"], torch.tensor(want, dtype=torch.float32))
    summed = shape("sum")["seq_reward"]
    torch.testing.assert_close(summed, r.rewards.float() + torch.tensor(pen) + bonus)
    raw = torch.tensor(_want_per_component()) + torch.tensor(pen) + bonus  # control: the terms added after
    assert (shape("per_component")["seq_reward"] - raw)[:4].abs().max() > 0.1


def test_dynamic_sampling_filters_on_the_reward_it_trains_on():
    """Group 0: the raw sums are equal (1 + 0.5 x 2 = 0 + 0.5 x 4), so summed it is dropped, yet per component its
    terms' z-scores (+-0.71 x 1 and -+0.71 x 0.5) do not cancel: a signal, kept. Group 1: only the second term varies,
    kept either way. Group 2: every term constant, dropped either way."""
    scores = {"acc": torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), "len": torch.tensor([2.0, 4.0, 3.0, 5.0, 7.0, 7.0])}
    weights = {"acc": torch.tensor([1.0] * 6), "len": torch.tensor([0.5] * 6)}
    raw = scores["acc"] + 0.5 * scores["len"]  # [2, 2, 2.5, 3.5, 4.5, 4.5]
    result = SimpleNamespace(rewards=raw, valid=torch.ones(6, dtype=torch.bool), sources=scores, weights=weights)
    rollout = SimpleNamespace(rewards=result, group_ids=torch.tensor([0, 0, 1, 1, 2, 2]))
    kept = {c: filter_groups(*group_rewards(rollout, combination=c)).kept_groups.tolist()
            for c in ("sum", "per_component")}
    assert kept == {"sum": [1], "per_component": [0, 1]}


def test_select_and_concat_carry_the_weights():
    r = _result()
    rows = Rollout(list(range(8)), GROUPS, [[1]] * 8, [[2]] * 8, [None] * 8, [True] * 8, [{}] * 8, [""] * 8,
                   LABELS, [None] * 8, [[]] * 8, [None] * 8)
    scored = ScoredRollout(rows, r, SamplingSettings())
    picked = scored.select([4, 5, 6, 7])
    assert picked.rewards.weights["acc"].tolist() == [1.0, 1.0, 1.0, 2.0]
    hand = dataclasses.replace(picked, rewards=dataclasses.replace(picked.rewards, weights={}))  # none: 0, not NaN
    joined = ScoredRollout.concat([picked, hand])
    assert joined.rewards.weights["quality"].tolist() == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_the_config_key():
    config = build_config({}, ["algorithm.reward_combination=per_component", "algorithm.advantage_eps=0.001"])
    s = experience_settings(config.algorithm, config.rollout, config.trainer)
    assert (s.reward_combination, s.reward_component_eps, s.reward_normalization) == ("per_component", 0.001, False)
    assert build_config({}).algorithm.reward_combination == "sum"
    with pytest.raises(ConfigError, match="reward_combination"):
        build_config({}, ["algorithm.reward_combination=mean"])
