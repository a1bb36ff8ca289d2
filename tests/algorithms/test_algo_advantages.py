"""Advantage estimators against loop references, properties, edge cases, and the registry."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_reference import (
    random_batch,
    ref_cpgd_clip_filter,
    ref_gae,
    ref_group_norm,
    ref_reinforce_baseline,
    ref_reward_to_go,
    ref_rloo,
    ref_whiten,
)
from mmrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from mmrlhf.registry import RegistryError

SEEDS = range(8)
ATOL = 1e-6
BUILTIN = ["gae", "grpo", "group_norm", "dr_grpo", "rloo", "reinforce", "reinforce++", "reinforce_baseline", "cpgd"]


def _run(name, r, m, v, g, **params):
    return compute_advantages(name, r, m, values=v, group_ids=g, **params)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_matches_loop(seed, holes, gamma, lam):
    r, m, v, g = random_batch(seed, holes=holes)
    adv, ret = _run("gae", r, m, v, g, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_family_matches_loop(seed):
    r, m, v, g = random_batch(seed)
    for name in ("grpo", "group_norm"):
        adv, ret = _run(name, r, m, v, g)
        torch.testing.assert_close(adv, ref_group_norm(r, m, g), atol=ATOL, rtol=0)
        torch.testing.assert_close(ret, adv)
    adv, _ = _run("grpo", r, m, v, g, norm_by_std=False)
    torch.testing.assert_close(adv, ref_group_norm(r, m, g, by_std=False), atol=ATOL, rtol=0)
    adv, _ = _run("dr_grpo", r, m, v, g)
    torch.testing.assert_close(adv, ref_group_norm(r, m, g, by_std=False), atol=ATOL, rtol=0)
    adv, _ = _run("cpgd", r, m, v, g)
    torch.testing.assert_close(adv, ref_group_norm(r, m, g, unbiased=False), atol=ATOL, rtol=0)
    adv, _ = _run("cpgd", r, m, v, g, weight="clip_filter")
    torch.testing.assert_close(adv, ref_cpgd_clip_filter(r, m, g), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_loop(seed):
    r, m, v, g = random_batch(seed)
    adv, ret = _run("rloo", r, m, v, g)
    torch.testing.assert_close(adv, ref_rloo(r, m, g), atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_family_matches_loop(seed, holes, gamma):
    r, m, v, g = random_batch(seed, holes=holes)
    rtg = ref_reward_to_go(r, m, gamma)
    for name in ("reinforce", "reinforce++"):
        adv, ret = _run(name, r, m, v, g, gamma=gamma)
        torch.testing.assert_close(ret, rtg, atol=ATOL, rtol=0)
        torch.testing.assert_close(adv, ref_whiten(rtg, m), atol=1e-5, rtol=0)
    adv, ret = _run("reinforce_baseline", r, m, v, g, gamma=gamma)
    ref_adv, ref_ret = ref_reinforce_baseline(r, m, g, gamma)
    torch.testing.assert_close(ret, ref_ret, atol=ATOL, rtol=0)
    torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=0)


def test_float32_inputs_agree_with_float64_reference():
    r, m, v, g = random_batch(123, dtype=torch.float32)
    adv, _ = _run("grpo", r, m, v, g)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref_group_norm(r.double(), m, g), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# properties

batches = st.integers(min_value=0, max_value=10_000)


@settings(max_examples=25, deadline=None)
@given(seed=batches, name=st.sampled_from(BUILTIN), holes=st.booleans())
def test_zero_outside_mask_and_finite(seed, name, holes):
    r, m, v, g = random_batch(seed, holes=holes)
    r = r.masked_fill(~m, float("nan"))  # garbage in the padding must not leak
    v = v.masked_fill(~m, float("inf"))
    adv, ret = _run(name, r, m, v, g)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~m] == 0).all() and (ret[~m] == 0).all()


@settings(max_examples=25, deadline=None)
@given(seed=batches)
def test_grpo_group_sums_to_zero(seed):
    r, m, v, g = random_batch(seed, min_len=1)
    adv, _ = _run("grpo", r, m, v, g)
    seq = adv[:, 0]  # every response has a first token, carrying its sequence advantage
    for gid in g.unique():
        assert abs(float(seq[g == gid].sum())) < 1e-6


@settings(max_examples=25, deadline=None)
@given(seed=batches, c=st.floats(min_value=0.05, max_value=20.0))
def test_grpo_invariant_to_reward_scale(seed, c):
    r, m, v, g = random_batch(seed)
    a1, _ = _run("grpo", r, m, v, g, eps=1e-12)
    a2, _ = _run("grpo", r * c, m, v, g, eps=1e-12)
    torch.testing.assert_close(a1, a2, atol=1e-6, rtol=1e-6)
    # with the default eps the invariance is approximate, and exact for the sign
    a3, _ = _run("grpo", r * c, m, v, g)
    assert torch.equal(torch.sign(a3), torch.sign(a1))


@settings(max_examples=25, deadline=None)
@given(seed=batches, holes=st.booleans())
def test_gae_lambda1_gamma1_is_reward_to_go_minus_value(seed, holes):
    r, m, v, g = random_batch(seed, holes=holes)
    adv, _ = _run("gae", r, m, v, g, gamma=1.0, lam=1.0)
    expected = torch.where(m, ref_reward_to_go(r, m, 1.0) - v, torch.zeros_like(v))
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=0)


@settings(max_examples=15, deadline=None)
@given(seed=batches)
def test_rloo_is_rescaled_dr_grpo(seed):
    # R_i - mean(others) = n/(n-1) (R_i - mean(all)): the two baselines differ only by the group-size factor
    r, m, v, g = random_batch(seed)
    a_rloo, _ = _run("rloo", r, m, v, g)
    a_dr, _ = _run("dr_grpo", r, m, v, g)
    n = torch.stack([(g == gi).sum() for gi in g]).double()
    factor = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n)).unsqueeze(-1)
    torch.testing.assert_close(a_rloo, a_dr * factor, atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# edge cases


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "cpgd"])
def test_singleton_and_zero_variance_groups_get_exact_zero(name):
    m = torch.ones(6, 3, dtype=torch.bool)
    r = torch.zeros(6, 3)
    r[:, -1] = torch.tensor([0.1, 0.1, 0.1, 5.0, 1.0, 0.0])  # group 0: all 0.1 (mean not exact in floats)
    g = torch.tensor([0, 0, 0, 7, 2, 2])  # group 7: size 1
    adv, _ = compute_advantages(name, r, m, group_ids=g)
    assert (adv[:4] == 0).all()
    assert (adv[4:] != 0).all()


@pytest.mark.parametrize("name", BUILTIN)
def test_all_empty_mask_gives_zeros(name):
    m = torch.zeros(4, 5, dtype=torch.bool)
    r = torch.randn(4, 5)
    adv, ret = compute_advantages(name, r, m, values=torch.randn(4, 5), group_ids=torch.tensor([1, 1, 2, 2]))
    assert (adv == 0).all() and (ret == 0).all()


def test_reinforce_constant_returns_give_zeros():
    m = torch.ones(3, 4, dtype=torch.bool)
    r = torch.zeros(3, 4)
    adv, ret = compute_advantages("reinforce", r, m)
    assert (adv == 0).all() and (ret == 0).all()


def test_missing_inputs_and_bad_params_raise():
    r, m = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", r, m)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", r, m)
    with pytest.raises(ValueError, match="accepts"):
        compute_advantages("grpo", r, m, group_ids=torch.tensor([0, 0]), lam=0.9)
    with pytest.raises(ValueError, match=r"\[B, A\]"):
        compute_advantages("grpo", r, m[:, :2], group_ids=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="weight"):
        compute_advantages("cpgd", r, m, group_ids=torch.tensor([0, 0]), weight="nope")


def test_float_mask_accepted():
    r, m, v, g = random_batch(5)
    a_bool, _ = compute_advantages("gae", r, m, values=v)
    a_float, _ = compute_advantages("gae", r, m.double(), values=v)
    torch.testing.assert_close(a_bool, a_float)


# ---------------------------------------------------------------------------------------------------------------
# registry


def test_registry_duplicate_and_unknown():
    with pytest.raises(RegistryError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda *a, **k: None)
    with pytest.raises(RegistryError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("fresh_" + uuid.uuid4().hex, aliases=("group_norm",))(lambda *a, **k: None)
    with pytest.raises(RegistryError) as exc:
        compute_advantages("grpoo", torch.zeros(1, 1), torch.ones(1, 1))
    for name in ADVANTAGE_ESTIMATORS.names():
        assert name in str(exc.value)


def test_user_estimator_by_decorator_and_by_path():
    name = "user_" + uuid.uuid4().hex

    @ADVANTAGE_ESTIMATORS.register(name)
    def twice(token_rewards, mask, *, values=None, group_ids=None):
        return token_rewards * 2, token_rewards

    r, m = torch.randn(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv, ret = compute_advantages(name, r, m)
    torch.testing.assert_close(adv, torch.where(m, 2 * r, 0.0))  # zeroed outside the mask by the entry point
    spec = f"{Path(__file__).parent / 'algo_reference.py'}:custom_estimator"
    adv, _ = compute_advantages(spec, r, m, scale=3.0)
    torch.testing.assert_close(adv, torch.where(m, 3 * r, 0.0))


@pytest.mark.parametrize("b,a", [(3, 0), (0, 4)])
def test_degenerate_shapes(b, a):
    from mmrlhf.algorithms.losses import POLICY_LOSSES, policy_loss
    from mmrlhf.algorithms.masked import AGG_MODES

    r = torch.zeros(b, a)
    m = torch.zeros(b, a, dtype=torch.bool)
    g = torch.arange(b) // 2
    for name in ADVANTAGE_ESTIMATORS.names():
        adv, ret = compute_advantages(name, r, m, values=r, group_ids=g)
        assert adv.shape == ret.shape == (b, a)
    for name in POLICY_LOSSES.names():
        for agg in AGG_MODES:
            loss, _ = policy_loss(name, r, r, r, m, agg=agg)
            assert loss.item() == 0.0


def test_cpgd_clip_filter_ignores_masked_out_samples():
    """Samples the reward engine masked out (empty mask, a group of their own) do not count in CPGD's N: adding
    them must not inflate the up-weighting of the informative groups."""
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0]])  # [B, A]; one group of 2 + one of 2
    m = torch.tensor([[True, False], [True, False], [True, False], [True, False]])
    g = torch.tensor([0, 0, 1, 1])
    base, _ = compute_advantages("cpgd", r, m, group_ids=g, weight="clip_filter")
    masked_r = torch.cat([r, torch.zeros(2, 2)])
    masked_m = torch.cat([m, torch.zeros(2, 2, dtype=torch.bool)])
    with_masked, _ = compute_advantages("cpgd", masked_r, masked_m, group_ids=torch.tensor([0, 0, 1, 1, 7, 8]),
                                        weight="clip_filter")
    torch.testing.assert_close(with_masked[:4], base)  # before the fix the scale grew from 4/2 to 6/2


def test_a_masked_sample_gets_a_group_of_its_own():
    """The one rule for samples the reward engine masked out (group filtering and advantages both use it): fresh ids,
    distinct from every real group and from each other; valid samples keep theirs."""
    from mmrlhf.algorithms.groups import isolate_invalid

    groups = torch.tensor([3, 3, 7, 7, 7])
    valid = torch.tensor([True, False, True, False, False])
    out = isolate_invalid(groups, valid)
    assert out[valid].tolist() == [3, 7]
    alone = out[~valid].tolist()
    assert len(set(alone)) == 3 and not set(alone) & {3, 7}


def test_no_sample_has_no_group():
    """A share whose every prompt was skipped has no sample: no group, no error (group filtering runs on it)."""
    from mmrlhf.algorithms.dynamic_sampling import filter_groups
    from mmrlhf.algorithms.groups import isolate_invalid

    none = torch.zeros(0, dtype=torch.long)
    assert isolate_invalid(none, torch.zeros(0, dtype=torch.bool)).tolist() == []
    sel = filter_groups(torch.zeros(0), none)
    assert sel.num_groups == 0 and sel.kept_groups.numel() == 0
