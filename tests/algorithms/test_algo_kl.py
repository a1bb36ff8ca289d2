"""KL estimators, KL in the reward and as a loss, and the controllers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_reference import ref_agg
from mmrlhf.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    approx_kl,
    kl_controller,
    kl_loss,
    kl_penalized_rewards,
)


def _lp(seed, b=4, a=6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, a, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(b, a, generator=g, dtype=torch.float64) * 4
    mask = torch.arange(a).unsqueeze(0) < torch.randint(0, a + 1, (b, 1), generator=g)
    return lp, ref, mask


def _ref_token(lp, ref, est):
    d = lp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[est]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), est=st.sampled_from(["k1", "k2", "k3"]))
def test_estimators_match_formula_and_respect_mask(seed, est):
    lp, ref, mask = _lp(seed)
    kl = approx_kl(lp, ref.masked_fill(~mask, -float("inf")), mask, est)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            expected = _ref_token(float(lp[i, t]), float(ref[i, t]), est) if mask[i, t] else 0.0
            assert math.isclose(float(kl[i, t]), expected, rel_tol=1e-9, abs_tol=1e-12)
    if est != "k1":
        assert (kl >= 0).all()


def test_k1_and_k3_are_unbiased_for_sampled_tokens():
    # tokens sampled from pi: the mean of k1 and of k3 estimates KL(pi || ref); k2 is biased for distant policies
    g = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(8, generator=g, dtype=torch.float64), 0)
    ref = torch.softmax(torch.randn(8, generator=g, dtype=torch.float64) * 2, 0)
    exact = float((pi * (pi.log() - ref.log())).sum())
    tokens = torch.multinomial(pi, 50_000, replacement=True, generator=g).view(1, -1)
    lp, rlp = pi.log()[tokens], ref.log()[tokens]
    mask = torch.ones_like(lp, dtype=torch.bool)
    for est in ("k1", "k3"):
        k = approx_kl(lp, rlp, mask, est)
        se = float(k.std()) / math.sqrt(k.numel())
        assert abs(float(k.mean()) - exact) < 5 * se
    k2 = approx_kl(lp, rlp, mask, "k2")
    assert abs(float(k2.mean()) - exact) > 5 * float(k2.std()) / math.sqrt(k2.numel())


def test_kl_is_zero_for_identical_policies_and_bad_estimator_raises():
    lp, _, mask = _lp(1)
    for est in ("k1", "k2", "k3"):
        assert (approx_kl(lp, lp, mask, est) == 0).all()
    with pytest.raises(ValueError, match="k1, k2, k3"):
        approx_kl(lp, lp, mask, "k4")


def test_k3_gradient_matches_analytic():
    lp, ref, mask = _lp(2)
    lp.requires_grad_(True)
    loss, metrics = kl_loss(lp, ref, mask, estimator="k3", agg="token-mean")
    loss.backward()
    # d/dx [exp(-(x - r)) - 1 + (x - r)] = 1 - exp(-(x - r))
    expected = torch.where(mask, (1 - torch.exp(-(lp.detach() - ref))) / mask.sum(), 0.0)
    torch.testing.assert_close(lp.grad, expected)
    kl_tok = torch.tensor([[_ref_token(float(a), float(b), "k3") for a, b in zip(ra, rb)]
                           for ra, rb in zip(lp.detach(), ref)], dtype=torch.float64)
    assert math.isclose(float(metrics["kl_loss"]), ref_agg(kl_tok, mask, "token-mean"), rel_tol=1e-9)


def test_kl_penalized_rewards():
    lp, ref, mask = _lp(3)
    rewards = torch.randn(lp.shape, dtype=torch.float64)
    out, metrics = kl_penalized_rewards(rewards, lp, ref, mask, 0.05, estimator="k1")
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            expected = float(rewards[i, t]) - 0.05 * (float(lp[i, t]) - float(ref[i, t])) if mask[i, t] else 0.0
            assert math.isclose(float(out[i, t]), expected, rel_tol=1e-9, abs_tol=1e-12)
    seq = [sum(float(lp[i, t] - ref[i, t]) for t in range(lp.shape[1]) if mask[i, t])
           for i in range(lp.shape[0]) if mask[i].any()]
    assert math.isclose(float(metrics["kl_seq"]), sum(seq) / len(seq), rel_tol=1e-9, abs_tol=1e-12)
    assert not out.requires_grad


def test_kl_statistics_ignore_masked_out_samples():
    """A sample the reward engine masked out (empty mask) must not pull kl_seq (the adaptive controller's input)
    towards 0."""
    lp = torch.tensor([[0.0, 0.0], [5.0, 5.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, False]])
    _, metrics = kl_penalized_rewards(torch.zeros_like(lp), lp, ref, mask, 0.1, estimator="k1")
    assert float(metrics["kl_seq"]) == 2.0  # the valid sample alone; averaging in the masked row gave 1.0


def _ref_adaptive(init, target, horizon, kls, n):
    beta, out = init, []
    for kl in kls:
        err = kl / target - 1
        err = -0.2 if err < -0.2 else 0.2 if err > 0.2 else err
        beta = beta * (1 + err * n / horizon)
        out.append(beta)
    return out


@settings(max_examples=20, deadline=None)
@given(kls=st.lists(st.floats(0.0, 30.0), min_size=1, max_size=20), n=st.integers(1, 256))
def test_adaptive_controller_matches_recurrence(kls, n):
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    got = [ctl.update(kl, n) for kl in kls]
    for a, b in zip(got, _ref_adaptive(0.1, 6.0, 10_000, kls, n)):
        assert math.isclose(a, b, rel_tol=1e-12)


def test_adaptive_controller_direction_and_checkpoint():
    ctl = kl_controller("adaptive", 0.1, target=1.0, horizon=100)
    assert ctl.update(5.0, 10) > 0.1  # KL above target: penalise more
    v = ctl.value
    assert ctl.update(0.1, 10) < v  # below: penalise less
    state = ctl.state_dict()
    twin = AdaptiveKLController(0.5, target=3.0, horizon=7)
    twin.load_state_dict(state)
    assert [ctl.update(2.0, 4) for _ in range(3)] == [twin.update(2.0, 4) for _ in range(3)]
    huge = AdaptiveKLController(0.1, target=1.0, horizon=1)
    assert huge.update(0.0, 1000) >= 0.0  # never flips sign into a KL bonus


def test_fixed_controller():
    ctl = kl_controller("fixed", 0.02)
    assert isinstance(ctl, FixedKLController)
    assert ctl.update(100.0, 64) == 0.02
    other = FixedKLController(0.5)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.02
    with pytest.raises(ValueError):
        kl_controller("pid", 0.1)
