"""``prepare_policy_targets`` returns new items: the step's items stay as they came."""

from __future__ import annotations

import torch

from mmrlhf.experience.batching import TrainItem
from mmrlhf.trainer.policy_update import PolicyUpdateSettings, prepare_policy_targets


def test_the_policy_targets_are_new_items_and_the_step_s_items_stay_as_they_came():
    """``prepare_policy_targets`` returns new items (a report, a retry or a re-score reads the originals)."""
    items = [TrainItem([1], [2, 3, 4], {}, {}, {"loss_mask": torch.tensor([True, True, False]),
                                               "action_log_probs": torch.zeros(3)})]
    before = dict(items[0].token)
    out, _ = prepare_policy_targets(items, PolicyUpdateSettings())
    assert items[0].token == before and "policy_loss_mask" not in items[0].token
    assert out[0] is not items[0]
    assert torch.equal(out[0].token["policy_loss_mask"], torch.tensor([True, True, False]))
    assert torch.equal(out[0].token["is_weight"], torch.ones(3))
