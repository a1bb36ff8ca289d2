"""Token entropy and the high-entropy (forking token) mask."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrlhf.algorithms.entropy import entropy_from_logits, high_entropy_mask, masked_scores


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


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.floats(0.01, 0.99), cuts=st.lists(st.integers(0, 6), max_size=3))
def test_high_entropy_mask_over_shares_is_the_whole_batch_mask(seed, top_p, cuts):
    """Rows split into shares (training ranks) in order, each ranked against every share's scores: together they
    keep exactly the whole batch's tokens, ties included (a share's ties come after the earlier shares')."""
    g = torch.Generator().manual_seed(seed)
    ent = (torch.rand(6, 5, generator=g) * 3).floor()  # many ties
    mask = torch.arange(5).unsqueeze(0) < torch.randint(0, 6, (6, 1), generator=g)
    bounds = [0, *sorted(cuts), 6]
    shares = [(ent[a:b], mask[a:b]) for a, b in zip(bounds, bounds[1:])]
    scores = [masked_scores(e, m) for e, m in shares]
    split = [high_entropy_mask(e, m, top_p, step_scores=scores, rank=r) for r, (e, m) in enumerate(shares)]
    assert torch.equal(torch.cat(split), high_entropy_mask(ent, mask, top_p))


def test_high_entropy_mask_per_share_quantile_differs():
    """Control: each share ranked against its own scores keeps other tokens than the whole batch."""
    ent = torch.tensor([[0.1, 0.2, 0.3], [0.7, 0.8, 0.9]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    whole = high_entropy_mask(ent, mask, 0.5)
    assert whole.tolist() == [[False, False, False], [True, True, True]]
    alone = torch.cat([high_entropy_mask(ent[i: i + 1], mask[i: i + 1], 0.5) for i in range(2)])
    assert not torch.equal(alone, whole)
