"""On-policy distillation estimator (mmrlhf.algorithms.distill) against an oracle written out token by token, and its
place in the step's shaping (mmrlhf.experience.step_shaping)."""

from __future__ import annotations

import math

import pytest
import torch

from mmrlhf.algorithms import compute_advantages
from mmrlhf.algorithms.distill import distill_metrics, mix_advantages, reverse_kl_advantages
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.experience.step_shaping import shape_step
from mmrlhf.parallel.world import single
from mmrlhf.rewards.types import RewardResult


def oracle(student: list[list[float]], teacher: list[list[float]], mask: list[list[int]], coef: float):
    """Thinking Machines' on-policy distillation advantage, one token at a time: the negative per-token reverse-KL
    estimate on the student's own sample, log p_teacher(x_t) - log p_student(x_t), scaled, no discounting and no sum
    over later tokens; 0 off the mask."""
    out = []
    for s_row, t_row, m_row in zip(student, teacher, mask):
        out.append([coef * (t - s) if m else 0.0 for s, t, m in zip(s_row, t_row, m_row)])
    return out


def test_matches_the_oracle_token_by_token():
    g = torch.Generator().manual_seed(0)
    student = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4  # [B, A] log-probs
    teacher = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    for coef in (1.0, 0.5, 2.0):
        got = reverse_kl_advantages(student, teacher, mask, coef=coef)
        want = torch.tensor(oracle(student.tolist(), teacher.tolist(), mask.int().tolist(), coef), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_sign_teacher_more_likely_is_positive():
    student = torch.log(torch.tensor([[0.1, 0.5, 0.9]]))
    teacher = torch.log(torch.tensor([[0.4, 0.5, 0.3]]))
    adv = reverse_kl_advantages(student, teacher, torch.ones(1, 3, dtype=torch.bool))
    assert adv[0, 0] > 0 and adv[0, 1] == 0 and adv[0, 2] < 0
    assert math.isclose(float(adv[0, 0]), math.log(4.0), rel_tol=1e-6)


def test_equal_models_give_zero_and_padding_never_leaks():
    lp = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, float("-inf"), float("-inf")]])  # -inf on padding
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = reverse_kl_advantages(lp, lp.clone(), mask, coef=3.0)
    assert torch.equal(adv, torch.zeros(2, 3)) and not torch.isnan(adv).any()
    other = torch.tensor([[-1.5, float("nan"), 7.0], [-0.1, 1.0, float("inf")]])  # junk off the mask
    adv = reverse_kl_advantages(lp, other, torch.tensor([[1, 0, 0], [1, 0, 0]], dtype=torch.bool))
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.0, 0.0], [0.4, 0.0, 0.0]]))


def test_is_a_detached_target_and_checks_inputs():
    student = torch.zeros(2, 2, requires_grad=True)
    adv = reverse_kl_advantages(student, torch.ones(2, 2), torch.ones(2, 2))
    assert not adv.requires_grad
    with pytest.raises(ValueError, match="same shape"):
        reverse_kl_advantages(torch.zeros(2, 2), torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match=">= 0"):
        reverse_kl_advantages(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2), coef=-1.0)
    with pytest.raises(ValueError, match="same shape"):
        mix_advantages(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(1, 2))


def test_mix_adds_the_task_advantage_on_the_mask():
    task = torch.tensor([[0.7, 0.7, 0.7], [-0.7, -0.7, 5.0]])  # 5.0 off the mask must not survive
    distill = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    torch.testing.assert_close(mix_advantages(task, distill, mask), torch.tensor([[0.8, 0.5, 0.7], [-0.4, -0.7, 0.0]]))


def test_metrics_are_the_mean_reverse_kl_estimate():
    s = torch.tensor([[-1.0, -2.0, 0.0]])
    t = torch.tensor([[-1.5, -1.0, 9.0]])
    m = distill_metrics(s, t, torch.tensor([[1, 1, 0]]))
    assert m["distill/reverse_kl"] == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)
    assert m["distill/teacher_logprob"] == pytest.approx(-1.25)
    assert distill_metrics(s, t, torch.zeros(1, 3)) == {"distill/reverse_kl": 0.0, "distill/teacher_logprob": 0.0}


def test_distill_estimator_zeroes_the_task_advantage():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    adv, ret = compute_advantages("distill", rewards, torch.ones(2, 2), group_ids=torch.tensor([0, 0]))
    assert torch.equal(adv, torch.zeros(2, 2)) and torch.equal(ret, torch.zeros(2, 2))


def _shape(settings: ExperienceSettings, teacher: torch.Tensor | None):
    """One step of 2 groups x 2 samples, 3 response tokens, the last sample one token long."""
    rewards = RewardResult(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), valid=torch.ones(4, dtype=torch.bool),
                           sources={}, parts={}, metrics={})
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    student = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.2, 0.2], [0.5, 0.5, 0.5], [0.9, 1.0, 1.0]]))
    return shape_step(settings, groups=[0, 0, 1, 1], rewards=rewards, lengths=mask.sum(-1), max_new_tokens=3,
                      mask=mask, log_probs=student, ref_log_probs=None, values=None, reward_norm=None,
                      kl_controller=None, world=single(), teacher_log_probs=teacher), student, mask


def test_shaping_adds_the_distillation_term_to_grpo():
    teacher = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.4, 0.2, 0.1], [0.5, 0.5, 0.5], [0.3, 0.7, 0.7]]))
    grpo = ExperienceSettings(n_samples_per_prompt=2, advantage_estimator="grpo",
                              advantage_params={"eps": 1e-6, "norm_by_std": True})
    base, student, mask = _shape(grpo, None)
    mixed, _, _ = _shape(ExperienceSettings(**{**grpo.__dict__, "distill_coef": 0.5}), teacher)
    want = base["advantages"] + torch.tensor(oracle(student.tolist(), teacher.tolist(), mask.int().tolist(), 0.5))
    torch.testing.assert_close(mixed["advantages"], want)
    assert mixed["metrics"]["distill/reverse_kl"] == pytest.approx(float((student - teacher)[mask].mean()), rel=1e-6)
    alone, _, _ = _shape(ExperienceSettings(**{**grpo.__dict__, "advantage_estimator": "distill",
                                               "advantage_params": {}, "distill_coef": 1.0}), teacher)
    torch.testing.assert_close(alone["advantages"],
                               torch.tensor(oracle(student.tolist(), teacher.tolist(), mask.int().tolist(), 1.0)))
    # a teacher equal to the student adds nothing
    same, _, _ = _shape(ExperienceSettings(**{**grpo.__dict__, "distill_coef": 2.0}), student.clone())
    torch.testing.assert_close(same["advantages"], base["advantages"])
    with pytest.raises(ValueError, match="teacher"):
        _shape(ExperienceSettings(**{**grpo.__dict__, "distill_coef": 1.0}), None)


def test_config_keys_are_checked_together():
    from mmrlhf.config import build_config

    with pytest.raises(ValueError, match="model.teacher"):
        build_config({"algorithm": {"distill_coef": 1.0}})
    with pytest.raises(ValueError, match="distill_coef"):
        build_config({"model": {"teacher": "/some/teacher"}})
    with pytest.raises(ValueError, match="distill_coef > 0"):
        build_config({"algorithm": {"advantage_estimator": "distill"}})
    cfg = build_config({"model": {"teacher": "/t"}, "algorithm": {"distill_coef": 0.5}})
    assert cfg.model.teacher == "/t" and cfg.algorithm.distill_coef == 0.5
