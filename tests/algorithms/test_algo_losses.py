"""Policy and value losses: values against loops, where clipping removes the gradient, aggregation modes."""

from __future__ import annotations

import math
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_reference import ref_agg
from mmrlhf.algorithms.losses import POLICY_LOSSES, policy_loss, value_loss
from mmrlhf.algorithms.masked import AGG_MODES, agg_loss
from mmrlhf.registry import RegistryError


def _inputs(seed, b=5, a=7, spread=0.5, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, a, generator=g, dtype=torch.float64) * 3
    logp = (old + spread * torch.randn(b, a, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(b, a, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, a + 1, (b,), generator=g)
    if empty_row:
        lengths[0] = 0
    mask = torch.arange(a).unsqueeze(0) < lengths.unsqueeze(1)
    return logp, old, adv, mask


def _ref_ppo_token(lp, old, a, cl, ch, dual=None):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - cl), 1 + ch))
    if dual is not None and a < 0:
        loss = min(loss, -dual * a)
    return loss


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cl,ch,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_matches_loop(seed, cl, ch, dual, agg):
    logp, old, adv, mask = _inputs(seed, spread=1.0)
    params = {} if dual is None else {"dual_clip": dual}
    loss, metrics = policy_loss("ppo", logp, old, adv, mask, clip_low=cl, clip_high=ch, agg=agg, **params)
    lp = logp.detach()
    per_tok = torch.tensor(
        [[_ref_ppo_token(float(lp[i, t]), float(old[i, t]), float(adv[i, t]), cl, ch, dual)
          for t in range(logp.shape[1])] for i in range(logp.shape[0])], dtype=torch.float64)
    assert math.isclose(loss.item(), ref_agg(per_tok, mask, agg), rel_tol=1e-9, abs_tol=1e-12)
    # clip fraction: tokens where the ratio left the band on the side the advantage sign says (dual excluded)
    n, clipped = 0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            n += 1
            r, a = math.exp(float(lp[i, t] - old[i, t])), float(adv[i, t])
            is_dual = dual is not None and a < 0 and r > dual
            clipped += ((a > 0 and r > 1 + ch) or (a < 0 and r < 1 - cl)) and not is_dual
    assert math.isclose(float(metrics["clip_frac"]), clipped / n, abs_tol=1e-6)  # metrics are float32


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cl=st.floats(0.05, 0.5),
    ch=st.floats(0.05, 0.5),
    dual=st.one_of(st.none(), st.floats(1.5, 5.0)),
)
def test_ppo_gradient_is_zero_exactly_where_clipped(seed, cl, ch, dual):
    logp, old, adv, mask = _inputs(seed, spread=1.5)
    params = {} if dual is None else {"dual_clip": dual}
    loss, _ = policy_loss("ppo", logp, old, adv, mask, clip_low=cl, clip_high=ch, **params)
    loss.backward()
    ratio = (logp - old).exp().detach()
    blocked = ((adv > 0) & (ratio > 1 + ch)) | ((adv < 0) & (ratio < 1 - cl))
    if dual is not None:
        blocked |= (adv < 0) & (ratio > dual)
    grad = logp.grad
    assert (grad[~mask] == 0).all()
    assert (grad[mask & blocked] == 0).all()
    assert (grad[mask & ~blocked & (adv != 0)] != 0).all()
    # the sign: a positive advantage pushes the log-prob up (negative gradient of the loss)
    free = mask & ~blocked
    assert (torch.sign(grad[free]) == -torch.sign(adv[free])).all()


def test_ppo_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([[math.log(10.0)]], dtype=torch.float64, requires_grad=True)  # ratio 10
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv = torch.tensor([[-2.0]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = policy_loss("ppo", logp, old, adv, mask, dual_clip=3.0)
    assert math.isclose(loss.item(), 3.0 * 2.0)
    loss.backward()
    assert logp.grad.item() == 0.0 and float(m["dual_clip_frac"]) == 1.0
    loss2, _ = policy_loss("ppo", logp, old, adv, mask)
    assert math.isclose(loss2.item(), 10.0 * 2.0)  # without dual clip the loss grows with the ratio


@pytest.mark.parametrize("seed", range(4))
def test_gspo_is_sequence_level(seed):
    logp, old, adv_tok, mask = _inputs(seed, spread=0.05)
    adv = adv_tok[:, :1].expand_as(adv_tok).contiguous()  # one advantage per sequence
    cl, ch = 0.01, 0.012
    loss, metrics = policy_loss("gspo", logp, old, adv, mask, clip_low=cl, clip_high=ch, agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    # reference: GSPO's sequence objective written directly, one term per non-empty sequence
    lp = logp.detach().clone().requires_grad_(True)
    terms = []
    for i in range(lp.shape[0]):
        idx = mask[i].nonzero().squeeze(-1)
        if idx.numel() == 0:
            continue
        s = torch.exp((lp[i, idx] - old[i, idx]).mean())
        a = adv[i, 0]
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - cl, 1 + ch)))
    ref = torch.stack(terms).mean()
    (ref_grad,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(grad, ref_grad)
    # the whole sequence is clipped together: within a row the gradient is all zero or all non-zero
    for i in range(grad.shape[0]):
        g = grad[i][mask[i]]
        assert (g == 0).all() or (g != 0).all()


def test_cispo_keeps_gradient_of_clipped_tokens():
    logp, old, adv, mask = _inputs(3, spread=1.0)
    loss, metrics = policy_loss("cispo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    ratio = (logp - old).exp().detach()
    w = ratio.clamp(0.8, 1.2)
    n = mask.sum()
    expected_grad = torch.where(mask, -w * adv / n, torch.zeros_like(w))
    torch.testing.assert_close(logp.grad, expected_grad)
    torch.testing.assert_close(loss.detach(), (torch.where(mask, -w * adv, 0.0)).sum() / n)
    out = mask & ((ratio < 0.8) | (ratio > 1.2))
    assert out.any() and (logp.grad[out] != 0).all()
    assert math.isclose(float(metrics["clip_frac"]), float(out.sum() / n), abs_tol=1e-6)


def test_cpgd_loss_matches_loop_and_blocks_clipped_gradient():
    logp, old, adv, mask = _inputs(4, spread=0.5)
    cl, ch, beta = 0.2, 0.2, 0.1
    loss, metrics = policy_loss("cpgd", logp, old, adv, mask, clip_low=cl, clip_high=ch, drift_coef=beta)
    ref_tok = []
    for i in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            lr, a = float(logp.detach()[i, t] - old[i, t]), float(adv[i, t])
            clipped = min(max(lr, math.log(1 - cl)), math.log(1 + ch))
            row.append(max(-a * lr, -a * clipped) + beta * (math.exp(lr) - 1 - lr))
        ref_tok.append(row)
    assert math.isclose(loss.item(), ref_agg(torch.tensor(ref_tok, dtype=torch.float64), mask, "token-mean"),
                        rel_tol=1e-9)
    loss_nodrift, _ = policy_loss("cpgd", logp, old, adv, mask, clip_low=cl, clip_high=ch)
    loss_nodrift.backward()
    lr = (logp - old).detach()
    blocked = ((adv > 0) & (lr > math.log(1 + ch))) | ((adv < 0) & (lr < math.log(1 - cl)))
    assert (logp.grad[mask & blocked] == 0).all()
    # inside the band the gradient is the plain policy gradient -A / n_tokens, without ratio weighting
    free = mask & ~blocked
    torch.testing.assert_close(logp.grad[free], (-adv / mask.sum())[free])


# ---------------------------------------------------------------------------------------------------------------
# aggregation


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(AGG_MODES), norm_len=st.sampled_from([None, 16]))
def test_agg_modes_match_loop(seed, mode, norm_len):
    g = torch.Generator().manual_seed(seed)
    b, a = 1 + seed % 5, 1 + seed % 7
    loss = torch.randn(b, a, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, a + 1, (b,), generator=g)
    mask = torch.arange(a).unsqueeze(0) < lengths.unsqueeze(1)
    got = float(agg_loss(loss.masked_fill(~mask, float("nan")), mask, mode, norm_len=norm_len))
    assert math.isclose(got, ref_agg(loss, mask, mode, norm_len), rel_tol=1e-9, abs_tol=1e-12)


def test_agg_modes_weight_uneven_lengths_as_documented():
    # two responses, lengths 1 and 3, per-token losses a (short) and b (long)
    a_val, b_val = 2.0, 5.0
    loss = torch.tensor([[a_val, 9.0, 9.0], [b_val, b_val, b_val]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    tm = float(agg_loss(loss, mask, "token-mean"))
    smtm = float(agg_loss(loss, mask, "seq-mean-token-mean"))
    smts = float(agg_loss(loss, mask, "seq-mean-token-sum"))
    norm = float(agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10))
    assert math.isclose(tm, (a_val + 3 * b_val) / 4)  # every token weighs the same
    assert math.isclose(smtm, (a_val + b_val) / 2)  # every sequence weighs the same
    assert math.isclose(smts, (a_val + 3 * b_val) / 2)  # sums, averaged over sequences
    assert math.isclose(norm, smts / 10)  # the same, divided by a constant
    assert math.isclose(float(agg_loss(loss, mask, "seq-mean-token-sum-norm")), smts / 3)  # default: padded length
    # equal lengths: token-mean and seq-mean-token-mean coincide
    full = torch.ones_like(mask)
    assert math.isclose(float(agg_loss(loss, full, "token-mean")), float(agg_loss(loss, full, "seq-mean-token-mean")))


def test_empty_mask_loss_is_zero_and_differentiable():
    logp, old, adv, _ = _inputs(0)
    mask = torch.zeros_like(adv, dtype=torch.bool)
    for name in ("ppo", "gspo", "cispo", "cpgd", "sapo"):
        for agg in AGG_MODES:
            loss, metrics = policy_loss(name, logp, old, adv, mask, agg=agg)
            assert loss.item() == 0.0
            (grad,) = torch.autograd.grad(loss, logp)
            assert (grad == 0).all()
            assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "cpgd", "sapo"])
def test_garbage_in_padding_never_reaches_loss_or_gradient(name):
    logp, old, adv, mask = _inputs(1)
    dirty = logp.detach().masked_fill(~mask, float("nan")).requires_grad_(True)
    old_dirty = old.masked_fill(~mask, -float("inf"))
    loss, metrics = policy_loss(name, dirty, old_dirty, adv.masked_fill(~mask, float("nan")), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(dirty.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    clean, _ = policy_loss(name, logp, old, adv, mask)
    torch.testing.assert_close(loss.detach(), clean.detach())


def test_common_metrics_and_entropy_bonus():
    logp, old, adv, mask = _inputs(2)
    ent = torch.rand_like(adv)
    base, m0 = policy_loss("ppo", logp, old, adv, mask)
    bonus, m1 = policy_loss("ppo", logp, old, adv, mask, entropy=ent, entropy_coef=0.01)
    ent_mean = ref_agg(ent, mask, "token-mean")
    assert math.isclose((base - bonus).item(), 0.01 * ent_mean, rel_tol=1e-9)
    assert math.isclose(float(m1["entropy"]), ent_mean, rel_tol=1e-9)
    lp = logp.detach()
    lr = [float(lp[i, t] - old[i, t]) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    k3 = sum(math.exp(x) - 1 - x for x in lr) / len(lr)
    assert math.isclose(float(m0["approx_kl"]), k3, rel_tol=1e-9)
    assert all(not v.requires_grad for v in m0.values())


def test_loss_registry():
    with pytest.raises(RegistryError) as exc:
        policy_loss("ppoo", *_inputs(0))
    assert "ppo" in str(exc.value) and "gspo" in str(exc.value) and "cispo" in str(exc.value)
    with pytest.raises(RegistryError, match="already registered"):
        POLICY_LOSSES.register("ppo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="accepts"):
        policy_loss("ppo", *_inputs(0), drift_coef=0.1)
    name = "pg_" + uuid.uuid4().hex

    @POLICY_LOSSES.register(name)
    def plain_pg(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high):
        return -advantages * logprobs, {}

    logp, old, adv, mask = _inputs(0)
    loss, metrics = policy_loss(name, logp, old, adv, mask, agg="seq-mean-token-sum")
    assert math.isclose(loss.item(), ref_agg(-adv * logp.detach(), mask, "seq-mean-token-sum"), rel_tol=1e-9)
    assert "approx_kl" in metrics


# ---------------------------------------------------------------------------------------------------------------
# value loss


@pytest.mark.parametrize("clip", [None, 0.1, 0.5])
def test_value_loss_matches_loop_and_blocks_clipped_gradient(clip):
    g = torch.Generator().manual_seed(7)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64)
    values = (old + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    returns = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([[6], [3], [1], [0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=clip)
    loss.backward()
    ref, n_clip = [], 0
    for i in range(4):
        row = []
        for t in range(6):
            v, vo, ret = float(values.detach()[i, t]), float(old[i, t]), float(returns[i, t])
            un = (v - ret) ** 2
            if clip is None:
                row.append(0.5 * un)
                continue
            vc = vo + min(max(v - vo, -clip), clip)
            cl = (vc - ret) ** 2
            row.append(0.5 * max(un, cl))
            if mask[i, t] and cl > un:
                n_clip += 1
                assert values.grad[i, t] == 0
        ref.append(row)
    assert math.isclose(loss.item(), ref_agg(torch.tensor(ref, dtype=torch.float64), mask, "token-mean"), rel_tol=1e-9)
    assert math.isclose(float(metrics["vf_clip_frac"]), n_clip / int(mask.sum()), abs_tol=1e-6)
    if clip == 0.1:
        assert n_clip > 0
