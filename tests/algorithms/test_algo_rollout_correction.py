"""Rollout correction (TIS / MIS) against an explicit per-token loop, and exact gradient accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from mmrlhf.algorithms.losses import policy_loss
from mmrlhf.algorithms.masked import agg_count, agg_loss
from mmrlhf.algorithms.rollout_correction import importance_ratios, rollout_correction


def _batch(seed=0, b=5, a=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, a, generator=g, dtype=torch.float64) * 3
    eng = old + torch.randn(b, a, generator=g, dtype=torch.float64) * 0.8
    mask = torch.rand(b, a, generator=g) > 0.3
    mask[-1] = False  # a sample masked out entirely
    return old, eng, mask


def test_token_ratios_match_a_loop_and_are_one_off_mask():
    old, eng, mask = _batch()
    r = importance_ratios(old, eng, mask, "token")
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            want = math.exp(old[i, t] - eng[i, t]) if mask[i, t] else 1.0
            assert math.isclose(float(r[i, t]), want, rel_tol=1e-9)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_ratios_are_per_response(level):
    old, eng, mask = _batch(1)
    r = importance_ratios(old, eng, mask, level)
    for i in range(old.shape[0]):
        toks = [float(old[i, t] - eng[i, t]) for t in range(old.shape[1]) if mask[i, t]]
        if not toks:
            assert torch.all(r[i] == 1)
            continue
        s = sum(toks) / (len(toks) if level == "geometric" else 1)
        want = math.exp(max(min(s, 20), -20))
        assert torch.allclose(r[i][mask[i]], torch.tensor(want, dtype=r.dtype), rtol=1e-6)


def test_tis_truncates_and_reports_raw_ratios():
    old, eng, mask = _batch(2)
    w, m, metrics = rollout_correction(old, eng, mask, mode="tis", cap=1.5)
    raw = importance_ratios(old, eng, mask)
    assert torch.equal(m, mask)  # TIS never drops a token
    assert torch.allclose(w[mask], raw[mask].clamp(max=1.5))
    assert float(metrics["rollout_is/ratio_max"]) == pytest.approx(float(raw[mask].max()))  # before truncation
    assert float(metrics["rollout_is/ratio_max"]) > 1.5
    assert float(metrics["rollout_is/truncated_frac"]) == pytest.approx(float((raw[mask] > 1.5).float().mean()))


def test_mis_masks_whole_responses_at_sequence_level():
    old, eng, mask = _batch(3)
    w, m, metrics = rollout_correction(old, eng, mask, mode="mis", level="sequence", cap=2.0, lower=0.5)
    raw = importance_ratios(old, eng, mask, "sequence")
    for i in range(old.shape[0]):
        if not mask[i].any():
            continue
        ratio = float(raw[i][mask[i]][0])
        kept = 0.5 <= ratio <= 2.0
        assert bool(m[i].any()) == kept and torch.equal(m[i], mask[i] & kept)
    assert 0 < float(metrics["rollout_is/masked_frac"]) < 1


def test_none_mode_reports_the_gap_but_changes_nothing():
    old, eng, mask = _batch(4)
    w, m, metrics = rollout_correction(old, eng, mask, mode="none")
    assert torch.all(w == 1) and torch.equal(m, mask)
    assert float(metrics["rollout_is/abs_log_ratio_mean"]) > 0.1


def test_bad_arguments_are_named():
    old, eng, mask = _batch()
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(old, eng, mask, mode="tiss")
    with pytest.raises(ValueError, match="level"):
        rollout_correction(old, eng, mask, level="tokens")
    with pytest.raises(ValueError, match="cap"):
        rollout_correction(old, eng, mask, cap=1.0, lower=2.0)


def test_token_weights_scale_the_per_token_loss():
    old, _, mask = _batch(5)
    lp = (old + 0.01).requires_grad_(True)
    adv = torch.randn(old.shape, dtype=torch.float64)
    w = torch.rand(old.shape, dtype=torch.float64) + 0.5
    weighted, _ = policy_loss("ppo", lp, old, adv, mask, token_weights=w)
    ratio = (lp - old).exp()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * w
    assert torch.allclose(weighted, per_token[mask].mean())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_micro_batches_with_the_mini_batch_denominator_sum_to_the_mini_batch_loss(mode):
    g = torch.Generator().manual_seed(6)
    loss = torch.randn(9, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(9, 6, generator=g) > 0.4
    mask[2] = False
    whole = agg_loss(loss, mask, mode, norm_len=6)
    denom = agg_count(mask, mode)
    parts = sum(agg_loss(loss[s:s + 4], mask[s:s + 4], mode, norm_len=6, denominator=denom) for s in range(0, 9, 4))
    assert torch.allclose(parts, whole)
    # control: averaging the micro-batch means is NOT the mini-batch loss
    naive = sum(agg_loss(loss[s:s + 4], mask[s:s + 4], mode, norm_len=6) for s in range(0, 9, 4)) / 3
    assert not torch.allclose(naive, whole)
