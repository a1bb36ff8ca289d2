"""Token entropy and the high-entropy (forking token) mask."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrlhf.algorithms.entropy import entropy_from_logits, high_entropy_mask


def test_entropy_matches_loop_and_handles_masked_vocab():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64) * 3
    logits[0, 0, :3] = -float("inf")  # banned vocabulary entries
    ent = entropy_from_logits(logits)
    for i in range(2):
        for t in range(3):
            z = [float(v) for v in logits[i, t]]
            mx = max(z)
            ps = [math.exp(v - mx) for v in z]
            s = sum(ps)
            ps = [p / s for p in ps]
            expected = -sum(p * math.log(p) for p in ps if p > 0)
            assert math.isclose(float(ent[i, t]), expected, rel_tol=1e-9, abs_tol=1e-12)
    assert torch.isfinite(ent).all()
    uniform = entropy_from_logits(torch.zeros(5, dtype=torch.float64))
    assert math.isclose(float(uniform), math.log(5), rel_tol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.floats(0.01, 1.0), ties=st.booleans())
def test_high_entropy_mask_keeps_top_fraction(seed, top_p, ties):
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(4, 6, generator=g)
    if ties:
        ent = (ent * 3).floor()  # many equal entropies
    mask = torch.arange(6).unsqueeze(0) < torch.randint(0, 7, (4, 1), generator=g)
    keep = high_entropy_mask(ent, mask, top_p)
    n = int(mask.sum())
    assert int(keep.sum()) == math.ceil(top_p * n) if top_p < 1.0 else int(keep.sum()) == n
    assert not (keep & ~mask).any()
    if keep.any() and (mask & ~keep).any():
        assert ent[keep].min() >= ent[mask & ~keep].max()


def test_high_entropy_mask_edges():
    ent = torch.rand(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert torch.equal(high_entropy_mask(ent, mask, 1.0), mask)
    assert not high_entropy_mask(ent, torch.zeros_like(mask), 0.2).any()
    with pytest.raises(ValueError):
        high_entropy_mask(ent, mask, 0.0)
