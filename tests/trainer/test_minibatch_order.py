"""Mini-batch order: a fresh permutation per epoch that keeps the samples of one prompt group adjacent, so the
shared-prompt layout finds siblings in the same micro-batch."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.trainer.minibatch import epoch_order, minibatches

GROUPS = [3, 0, 1, 0, 3, 2, 1, 2, 0, 3, 1, 2]  # 4 groups of 3, members scattered


def _runs(order: list[int]) -> int:
    """How many maximal runs of equal group ids the order makes (4 = every group contiguous)."""
    ids = [GROUPS[i] for i in order]
    return 1 + sum(a != b for a, b in zip(ids, ids[1:]))


def test_groups_stay_adjacent_and_every_item_appears_once():
    g = torch.Generator().manual_seed(0)
    orders = [epoch_order(len(GROUPS), g, GROUPS) for _ in range(5)]
    for order in orders:
        assert sorted(order) == list(range(len(GROUPS)))
        assert _runs(order) == 4
    assert len({tuple(o) for o in orders}) > 1  # a fresh permutation per epoch
    # control: the plain permutation scatters the groups
    assert _runs(epoch_order(len(GROUPS), torch.Generator().manual_seed(0), None)) > 4


def test_order_is_reproducible_and_in_order_without_a_generator():
    a = epoch_order(len(GROUPS), torch.Generator().manual_seed(7), GROUPS)
    b = epoch_order(len(GROUPS), torch.Generator().manual_seed(7), GROUPS)
    assert a == b
    assert epoch_order(len(GROUPS), None, GROUPS) == list(range(len(GROUPS)))
    with pytest.raises(ValueError, match="3 group keys for 12 items"):
        epoch_order(12, torch.Generator(), GROUPS[:3])


def test_micro_batches_of_group_size_hold_one_group_each():
    micro = [m for _, micros in minibatches(12, 6, 3, 2, torch.Generator().manual_seed(1), GROUPS) for m in micros]
    assert len(micro) == 8
    assert all(len({GROUPS[i] for i in m}) == 1 for m in micro)
