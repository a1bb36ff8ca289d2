"""The scale-sized float32 tolerance (mmrlhf.testing.tolerances) accepts summation-order noise at entries near zero
and still rejects real differences."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.testing.tolerances import assert_close_at_scale, assert_no_farther, close_at_scale, scale_atol


def test_noise_at_an_entry_near_zero_passes_where_an_absolute_tolerance_fails():
    g = torch.linspace(-2.0, 2.0, 65_536)
    g[123] = 1e-3  # an entry near zero, next to entries of the tensor's scale (2)
    noisy = g.clone()
    noisy[123] += 1.43e-6  # the AVX-512 case: 1.5e-3 of the entry, 7e-7 of the tensor's scale
    with pytest.raises(AssertionError):
        torch.testing.assert_close(noisy, g, rtol=1e-4, atol=1e-6)  # the old absolute tolerance
    assert_close_at_scale(noisy, g)


def test_real_differences_fail():
    g = torch.linspace(-0.02, 0.02, 1024)
    assert not close_at_scale(g * 1.001, g)  # 0.1% everywhere
    off = g.clone()
    off[512] += 3e-6  # an entry near zero off by 15 times the scale slack (2e-7)
    assert not close_at_scale(off, g)
    assert close_at_scale(g.clone(), g)


def test_zero_tensor_needs_zeros():
    z = torch.zeros(4)
    assert scale_atol(z) < 1e-30
    assert not close_at_scale(torch.full((4,), 1e-8), z)


def test_a_path_as_noisy_as_the_baseline_passes_and_one_ten_times_farther_fails():
    """Two float32 paths both ~3e-4 of the scale from float64 (TF32 convolutions on CUDA) pass, though they differ by
    more than the summation bound; the control, an error 10x the baseline's, fails."""
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(64, 64, generator=gen, dtype=torch.float64)
    top = float(reference.abs().max())
    baseline = (reference + 3e-4 * top * (2 * torch.rand(64, 64, generator=gen, dtype=torch.float64) - 1)).float()
    same_noise = (reference + 3e-4 * top * (2 * torch.rand(64, 64, generator=gen, dtype=torch.float64) - 1)).float()
    assert not close_at_scale(same_noise, baseline)  # the summation-order bound would call them different
    assert_no_farther(same_noise, baseline, reference)
    worse = (reference + 3e-3 * top * torch.sign(reference)).float()
    with pytest.raises(AssertionError, match="float64"):
        assert_no_farther(worse, baseline, reference)
