"""The top-k distillation loss term (mmrlhf.algorithms.distill_topk) against a KL written out token by token, its
gradient at teacher == student, and its bounds against the full-vocabulary KL."""

from __future__ import annotations

import math

import pytest
import torch

from mmrlhf.algorithms.distill_topk import TAIL_FLOOR, topk_kl, topk_metrics


def oracle(student: list, teacher: list, mask: list, direction: str) -> list[list[float]]:
    """Per token: the KL of the two models' distributions over k + 1 outcomes (the teacher's k tokens, then
    everything else), one position at a time, in plain floats; 0 off the mask."""
    out = []
    for s_row, t_row, m_row in zip(student, teacher, mask):
        row = []
        for s_lp, t_lp, m in zip(s_row, t_row, m_row):
            if not m:
                row.append(0.0)
                continue
            s = [math.exp(x) for x in s_lp] + [max(1.0 - sum(math.exp(x) for x in s_lp), TAIL_FLOOR)]
            t = [math.exp(x) for x in t_lp] + [max(1.0 - sum(math.exp(x) for x in t_lp), TAIL_FLOOR)]
            p, q = (s, t) if direction == "reverse" else (t, s)
            row.append(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q)))
        out.append(row)
    return out


def _topk_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, A, V] logits -> [B, A, k] log-probs at ``ids``."""
    return torch.log_softmax(logits, dim=-1).gather(-1, ids)


def _pair(seed: int = 0, b: int = 2, a: int = 4, v: int = 11, k: int = 3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(b, a, v, generator=g, dtype=dtype)
    t_logits = 2.0 * torch.randn(b, a, v, generator=g, dtype=dtype)
    ids = t_logits.topk(k, dim=-1).indices  # [B, A, k] the teacher's top-k
    return s_logits, t_logits, ids


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_matches_the_oracle_token_by_token(direction):
    s_logits, t_logits, ids = _pair()
    student, teacher = _topk_of(s_logits, ids), _topk_of(t_logits, ids)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    got = topk_kl(student, teacher, mask, direction=direction)
    want = torch.tensor(oracle(student.tolist(), teacher.tolist(), mask.tolist(), direction), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got[mask] > 0).all() and (got[~mask] == 0).all()


def test_float32_inputs_agree_with_the_float64_oracle_at_their_precision():
    s_logits, t_logits, ids = _pair(seed=3, dtype=torch.float32)
    student, teacher = _topk_of(s_logits, ids), _topk_of(t_logits, ids)
    mask = torch.ones(student.shape[:2], dtype=torch.bool)
    for direction in ("reverse", "forward"):
        got = topk_kl(student, teacher, mask, direction=direction)
        assert got.dtype == torch.float32
        want = torch.tensor(oracle(student.tolist(), teacher.tolist(), mask.tolist(), direction))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_teacher_equal_to_student_gives_zero_loss_and_zero_gradient(direction):
    """Through the student's logits: the log-softmax, the gather at the teacher's top-k and the KL."""
    s_logits, _, _ = _pair(seed=1)
    logits = s_logits.clone().requires_grad_(True)
    ids = s_logits.topk(3, dim=-1).indices  # the teacher IS the student
    teacher = _topk_of(s_logits, ids)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    kl = topk_kl(_topk_of(logits, ids), teacher, mask, direction=direction)
    kl.sum().backward()
    assert float(kl.detach().abs().max()) < 1e-14
    assert float(logits.grad.abs().max()) < 1e-14
    # the control: another teacher gives a positive loss and a gradient on the masked positions only
    logits.grad = None
    other = _topk_of(s_logits + torch.linspace(0, 3, s_logits.shape[-1], dtype=s_logits.dtype), ids)
    kl = topk_kl(_topk_of(logits, ids), other, mask, direction=direction)
    kl.sum().backward()
    assert (kl[mask] > 1e-3).all()
    grad_norm = logits.grad.norm(dim=-1)  # [B, A]
    assert (grad_norm[mask] > 1e-3).all() and (grad_norm[~mask] == 0).all()


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_bounded_by_the_full_kl_and_equal_to_it_over_the_whole_vocabulary(direction):
    s_logits, t_logits, _ = _pair(seed=2, v=9)
    mask = torch.ones(s_logits.shape[:2], dtype=torch.bool)
    s_all, t_all = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)  # [B, A, V]
    p, q = (s_all, t_all) if direction == "reverse" else (t_all, s_all)
    full = (p.exp() * (p - q)).sum(-1)  # [B, A]
    for k in (1, 4, 8):
        ids = t_logits.topk(k, dim=-1).indices
        got = topk_kl(s_all.gather(-1, ids), t_all.gather(-1, ids), mask, direction=direction)
        assert (got <= full + 1e-12).all() and (got >= 0).all()
    # k = V - 1 leaves one token in the tail bucket: the coarsening loses nothing, the KL is the full one
    ids = t_logits.topk(s_logits.shape[-1] - 1, dim=-1).indices
    got = topk_kl(s_all.gather(-1, ids), t_all.gather(-1, ids), mask, direction=direction)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)


def test_padding_never_reaches_the_loss_or_the_gradient():
    s_logits, t_logits, ids = _pair(seed=4)
    student = _topk_of(s_logits, ids).clone()
    teacher = _topk_of(t_logits, ids).clone()
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    student[~mask], teacher[~mask] = float("-inf"), 0.0  # junk a padded batch may hold
    leaf = student.clone().requires_grad_(True)
    kl = topk_kl(leaf, teacher, mask, direction="reverse")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(leaf.grad).all()
    assert (kl[~mask] == 0).all() and (leaf.grad[~mask] == 0).all()
    clean = topk_kl(_topk_of(s_logits, ids), _topk_of(t_logits, ids), mask, direction="reverse")
    torch.testing.assert_close(kl, clean, rtol=0, atol=0)


def test_metrics_and_input_checks():
    s_logits, t_logits, ids = _pair(seed=5)
    student, teacher = _topk_of(s_logits, ids), _topk_of(t_logits, ids)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
    kl = topk_kl(student, teacher, mask)
    m = topk_metrics(kl, teacher, mask)
    assert m["distill_topk_kl"] == pytest.approx(float(kl[mask].mean()), rel=1e-12)
    assert m["distill_teacher_topk_mass"] == pytest.approx(float(teacher.exp().sum(-1)[mask].mean()), rel=1e-12)
    assert topk_metrics(kl, teacher, torch.zeros_like(mask)) == {"distill_topk_kl": 0.0,
                                                                 "distill_teacher_topk_mass": 0.0}
    with pytest.raises(ValueError, match="distill_loss_kl"):
        topk_kl(student, teacher, mask, direction="sideways")
    with pytest.raises(ValueError, match=r"\[B, A, k\]"):
        topk_kl(student, teacher[..., :2], mask)
    with pytest.raises(ValueError, match=r"\[B, A, k\]"):
        topk_kl(student, teacher, mask[:, :3])


def test_config_keys_need_a_teacher_and_reach_the_maker_and_the_update():
    from mmrlhf.config import build_config
    from mmrlhf.experience.settings import experience_settings
    from mmrlhf.trainer.builder import policy_update_settings

    with pytest.raises(ValueError, match="distill_loss_coef > 0 needs model.teacher"):
        build_config({"algorithm": {"distill_loss_coef": 1.0}})
    with pytest.raises(ValueError, match="distill_loss_kl"):
        build_config({"model": {"teacher": "/t"}, "algorithm": {"distill_loss_coef": 1.0, "distill_loss_kl": "js"}})
    with pytest.raises(ValueError, match="distill_topk"):
        build_config({"model": {"teacher": "/t"}, "algorithm": {"distill_loss_coef": 1.0, "distill_topk": 0}})
    # the loss term alone is distillation too: a teacher, and the zero task advantage, are accepted with it
    cfg = build_config({"model": {"teacher": "/t"}, "algorithm": {
        "advantage_estimator": "distill", "distill_loss_coef": 0.5, "distill_topk": 8, "distill_loss_kl": "reverse"}})
    s = experience_settings(cfg.algorithm, cfg.rollout, cfg.trainer)
    assert s.distill_topk == 8 and s.distill_coef == 0 and s.teacher_needed
    p = policy_update_settings(cfg, "none")
    assert p.distill_loss_coef == 0.5 and p.distill_loss_kl == "reverse"
    # without the loss term no top-k is recorded (the advantage alone reads the sampled token only)
    cfg = build_config({"model": {"teacher": "/t"}, "algorithm": {"distill_coef": 1.0, "distill_topk": 8}})
    s = experience_settings(cfg.algorithm, cfg.rollout, cfg.trainer)
    assert s.distill_topk == 0 and s.teacher_needed
