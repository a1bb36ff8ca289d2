"""Dynamic sampling: the pure group filter, and the driver with a fake sampler."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrlhf.algorithms.dynamic_sampling import SampledGroups, fill_batch, filter_groups, first_in_step_order


def _ref_filter(rewards, gids, tol=0.0):
    order, members = [], {}
    for i, g in enumerate(gids):
        if g not in members:
            order.append(g)
            members[g] = []
        members[g].append(rewards[i])
    kept = [g for g in order if max(members[g]) - min(members[g]) > tol]
    return [g in kept for g in gids], kept


def _random_round(rng, n_groups, p_informative):
    rewards, gids = [], []
    ids = rng.sample(range(-50, 50), n_groups)
    for g in ids:
        size = rng.randint(1, 4)
        if rng.random() < p_informative and size > 1:
            vals = [float(rng.randint(0, 1)) for _ in range(size)]
            vals[0], vals[-1] = 0.0, 1.0
        else:
            v = float(rng.randint(0, 1))
            vals = [v] * size
        rewards += vals
        gids += [g] * size
    perm = list(range(len(gids)))
    rng.shuffle(perm)
    return [rewards[i] for i in perm], [gids[i] for i in perm]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), tol=st.sampled_from([0.0, 0.5, 1.0]))
def test_filter_groups_matches_loop(seed, tol):
    rng = random.Random(seed)
    rewards, gids = _random_round(rng, rng.randint(1, 6), 0.5)
    rewards = [r + rng.random() * 0.6 for r in rewards]  # spreads around the tolerances
    sel = filter_groups(torch.tensor(rewards), torch.tensor(gids), tol=tol)
    keep, kept = _ref_filter(rewards, gids, tol)
    assert sel.keep.tolist() == keep
    assert sel.kept_groups.tolist() == kept
    assert sel.num_groups == len(set(gids))


def test_singleton_and_constant_groups_dropped():
    sel = filter_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), torch.tensor([4, 4, 9, 9, 2]))
    assert sel.keep.tolist() == [False, False, True, True, False]
    assert sel.kept_groups.tolist() == [9]


class FakeSampler:
    """Replays a script of rounds and records how many times it was called."""

    def __init__(self, rounds):
        self.rounds = rounds
        self.calls = 0

    def __call__(self):
        rewards, gids = self.rounds[self.calls]
        self.calls += 1
        payload = [f"round{self.calls - 1}-sample{i}" for i in range(len(gids))]
        return SampledGroups(torch.tensor(rewards), torch.tensor(gids), payload)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), target=st.integers(1, 8), extra=st.integers(0, 4))
def test_fill_batch_matches_simulation(seed, target, extra):
    rng = random.Random(seed)
    script = [_random_round(rng, rng.randint(1, 5), rng.random()) for _ in range(extra + 1)]
    sampler = FakeSampler(script)
    result = fill_batch(sampler, target, extra)
    # reference simulation
    have, calls, parts = 0, 0, []
    while have < target and calls <= extra:
        rewards, gids = script[calls]
        calls += 1
        _, kept = _ref_filter(rewards, gids)
        chosen = kept[: target - have]
        have += len(chosen)
        if chosen:
            parts.append((calls - 1, [i for i, g in enumerate(gids) if g in chosen], chosen))
    assert sampler.calls == result.rounds == calls
    assert result.num_groups == have <= target
    assert result.full == (have == target)
    assert result.fill_rate == pytest.approx(have / target)
    assert result.extra_rounds == max(calls - 1, 0)
    assert len(result.parts) == len(parts)
    for part, (rnd, idx, chosen) in zip(result.parts, parts):
        assert part.indices.tolist() == idx
        assert part.group_ids.tolist() == chosen
        assert all(part.payload[i].startswith(f"round{rnd}-") for i in idx)
    metrics = result.metrics()
    assert metrics["dynamic_sampling/rounds"] == calls
    assert metrics["dynamic_sampling/sampled_groups"] == sum(len(set(script[k][1])) for k in range(calls))


def test_fill_batch_stops_when_full_and_trims_surplus():
    informative = ([0.0, 1.0, 0.0, 1.0, 1.0, 1.0], [1, 1, 2, 2, 3, 3])  # groups 1, 2 informative; 3 constant
    sampler = FakeSampler([informative] * 10)
    result = fill_batch(sampler, target_groups=3, max_extra_rounds=5)
    assert sampler.calls == 2 and result.full
    assert [p.group_ids.tolist() for p in result.parts] == [[1, 2], [1]]  # surplus group 2 of round 2 dropped
    assert result.parts[1].indices.tolist() == [0, 1]


def test_fill_batch_gives_up_after_extra_rounds_and_accepts_tuples():
    dead = ([1.0, 1.0], [0, 0])

    calls = []

    def sample():
        calls.append(1)
        return dead

    result = fill_batch(sample, target_groups=2, max_extra_rounds=3)
    assert len(calls) == 4 and result.parts == [] and result.fill_rate == 0.0 and not result.full
    with pytest.raises(ValueError):
        fill_batch(sample, target_groups=0, max_extra_rounds=1)


def test_first_in_step_order_takes_the_step_order_over_ranks():
    """Rank 0 holds the step's positions 0, 4, 6, rank 1 holds 1, 3, 9, rank 2 none: the 4 first are 0, 1, 3, 4."""
    assert first_in_step_order([[0, 4, 6], [1, 3, 9], []], room=4) == [[0, 1], [0, 1], []]
    assert first_in_step_order([[0, 4, 6], [1, 3, 9], []], room=10) == [[0, 1, 2], [0, 1, 2], []]
    assert first_in_step_order([[5], [2]], room=1) == [[], [0]]
    assert first_in_step_order([[5], [2]], room=0) == [[], []]
