"""Reward and advantage shaping against loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_reference import ref_whiten
from mmrlhf.algorithms.shaping import (
    RunningRewardNorm,
    clip_advantages,
    clip_rewards,
    cross_batch_normalize,
    overlong_penalty,
    token_level_rewards,
    whiten_advantages,
)


def _ref_overlong(length, max_len, buffer_len, factor):
    if length > max_len:
        return -factor
    if length > max_len - buffer_len:
        return -factor * (length - (max_len - buffer_len)) / buffer_len
    return 0.0


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=16),
    max_len=st.integers(1, 64),
    frac=st.floats(0.0, 1.0),
    factor=st.floats(0.0, 2.0),
)
def test_overlong_penalty_matches_piecewise_definition(lengths, max_len, frac, factor):
    buffer_len = int(frac * max_len)
    pen, metrics = overlong_penalty(torch.tensor(lengths), max_len, buffer_len, factor)
    expected = [_ref_overlong(n, max_len, buffer_len, factor) for n in lengths]
    for got, exp in zip(pen.tolist(), expected):
        assert math.isclose(got, exp, rel_tol=1e-5, abs_tol=1e-6)
    in_buf = sum(max_len - buffer_len < n <= max_len for n in lengths) / len(lengths)
    over = sum(n > max_len for n in lengths) / len(lengths)
    assert math.isclose(float(metrics["overlong_buffer_frac"]), in_buf, abs_tol=1e-6)
    assert math.isclose(float(metrics["overlong_truncated_frac"]), over, abs_tol=1e-6)
    # monotone: a longer response is never penalised less
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    vals = [pen[i].item() for i in order]
    assert all(a >= b - 1e-6 for a, b in zip(vals, vals[1:]))


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 10, 11)


def test_token_level_rewards_on_last_response_token():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = token_level_rewards(r, mask)
    expected = torch.zeros(4, 4)
    for i in range(4):
        idx = [t for t in range(4) if mask[i, t]]
        if idx:
            expected[i, idx[-1]] = r[i]
    torch.testing.assert_close(out, expected)


def test_running_norm_equals_statistics_of_everything_seen():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1 for n in (5, 1, 17, 8)]
    norm = RunningRewardNorm()
    for b in batches:
        out, metrics = norm(b)
    seen = torch.cat(batches)
    mean, std = float(seen.mean()), float(seen.std(unbiased=False))
    assert math.isclose(norm.mean, mean, rel_tol=1e-9) and math.isclose(norm.std, std, rel_tol=1e-9)
    torch.testing.assert_close(out, (batches[-1] - mean) / std)
    scale_only = RunningRewardNorm(center=False)
    scale_only.load_state_dict(norm.state_dict())
    out2, _ = scale_only(batches[-1], update=False)
    torch.testing.assert_close(out2, batches[-1] / std)  # sign preserved
    # checkpoint round trip continues identically
    twin = RunningRewardNorm()
    twin.load_state_dict(norm.state_dict())
    nxt = torch.randn(6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(norm(nxt)[0], twin(nxt)[0])


def test_running_norm_constant_and_first_rewards_are_finite():
    norm = RunningRewardNorm()
    out, _ = norm(torch.tensor([1.0]))
    assert out.tolist() == [0.0]  # one reward: scale 1, centred on itself
    out, _ = norm(torch.tensor([1.0, 1.0, 1.0]))
    assert torch.isfinite(out).all() and (out == 0).all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), clip=st.floats(0.1, 2.0))
def test_clipping_reports_what_it_clipped(seed, clip):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64) * 2
    mask = torch.arange(5).unsqueeze(0) < torch.randint(0, 6, (4, 1), generator=g)
    out, metrics = clip_advantages(x, mask, clip)
    n = int(mask.sum())
    n_clipped = sum(abs(float(x[i, t])) > clip for i in range(4) for t in range(5) if mask[i, t])
    assert math.isclose(float(metrics["advantage_clip_frac"]), n_clipped / n if n else 0.0, abs_tol=1e-6)
    assert (out[~mask] == 0).all() and (out.abs() <= clip).all()
    torch.testing.assert_close(out[mask & (x.abs() <= clip)], x[mask & (x.abs() <= clip)])
    r = x[:, 0]
    r_out, r_metrics = clip_rewards(r, clip)
    assert math.isclose(float(r_metrics["reward_clip_frac"]), float((r.abs() > clip).double().mean()), abs_tol=1e-6)
    torch.testing.assert_close(r_out, r.clamp(-clip, clip))
    same, none_metrics = clip_rewards(r, None)
    assert same is r and float(none_metrics["reward_clip_frac"]) == 0.0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_whiten_and_cross_batch_normalisation(seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(3, 5, generator=g, dtype=torch.float64) * (k + 1) + k for k in range(3)]
    masks = [torch.arange(5).unsqueeze(0) < torch.randint(1, 6, (3, 1), generator=g) for _ in parts]
    whole = torch.cat(parts)
    whole_mask = torch.cat(masks)
    w, metrics = whiten_advantages(whole, whole_mask)
    torch.testing.assert_close(w, ref_whiten(whole, whole_mask), atol=1e-7, rtol=0)
    # cross-batch: each part normalised with the pooled statistics == whitening the concatenation
    out, cb_metrics = cross_batch_normalize(parts, masks)
    torch.testing.assert_close(torch.cat(out), w, atol=1e-7, rtol=0)
    assert math.isclose(float(cb_metrics["advantage_mean"]), float(metrics["advantage_mean"]), rel_tol=1e-5)
    assert math.isclose(float(cb_metrics["advantage_tokens"]), float(whole_mask.sum()))
    # ... and differs from normalising each part on its own
    alone = torch.cat([whiten_advantages(p, m)[0] for p, m in zip(parts, masks)])
    assert not torch.allclose(alone, w, atol=1e-3)


def test_whitening_constant_or_empty_gives_zeros():
    x = torch.full((2, 3), 0.1)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert (whiten_advantages(x, mask)[0] == 0).all()
    out, _ = cross_batch_normalize([x, x[:1]], [mask, mask[:1]])
    assert all((o == 0).all() for o in out)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert (whiten_advantages(torch.randn(2, 3), empty)[0] == 0).all()
    out, _ = cross_batch_normalize([torch.randn(2, 3)], [empty])
    assert (out[0] == 0).all()
