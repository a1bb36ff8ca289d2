"""The columnar wire form of a step's items (``mmrlhf.experience.wire``): exact round trip for every kind of item,
tensors of their own afterwards, and clear errors."""

from __future__ import annotations

import pickle

import pytest
import torch

from mmrlhf.experience.batching import TrainItem
from mmrlhf.experience.wire import pack_items, unpack_items


def _items() -> list[TrainItem]:
    gen = torch.Generator().manual_seed(0)

    def token(a: int) -> dict[str, torch.Tensor]:
        return {"loss_mask": torch.rand(a, generator=gen) > 0.3, "action_log_probs": torch.randn(a, generator=gen),
                "advantages": torch.randn(a, generator=gen, dtype=torch.float64)}

    def info(r: float) -> dict[str, torch.Tensor]:
        return {"reward": torch.tensor(r), "group": torch.tensor(3)}

    text = TrainItem([1, 2, 3], [4, 5], {}, {}, token(2), info(1.0))
    image = TrainItem([1, 9, 9, 2], [6, 7, 8], {"pixel_values": torch.randn(16, 12, generator=gen),
                                                "image_grid_thw": torch.tensor([[1, 4, 4]])}, {}, token(3), info(0.0))
    video = TrainItem([1, 8, 2], [6], {"pixel_values_videos": torch.randn(32, 12, generator=gen),
                                       "video_grid_thw": torch.tensor([[2, 4, 4]])},
                      {"second_per_grid_ts": torch.tensor([0.5])}, token(1), info(0.5))
    turns = TrainItem([1, 2], [3, 4, 5, 6], {}, {}, token(4), {**info(1.0), "extra": torch.tensor(True)},
                      policy_mask=torch.tensor([True, False, False, True]))
    routed = TrainItem([1, 2], [3], {}, {}, token(1), info(0.0),
                       routed_experts=torch.randint(-1, 4, (3, 2, 2), generator=gen).to(torch.int16))
    return [text, image, video, turns, routed]


def _same(a: TrainItem, b: TrainItem) -> None:
    assert (a.prompt_ids, a.response_ids) == (b.prompt_ids, b.response_ids)
    for name in ("vision", "vision_extra", "token", "info"):
        da, db = getattr(a, name), getattr(b, name)
        assert da.keys() == db.keys(), name
        for k in da:
            assert da[k].dtype == db[k].dtype and da[k].shape == db[k].shape and torch.equal(da[k], db[k]), (name, k)
    assert (a.policy_mask is None) == (b.policy_mask is None)
    if a.policy_mask is not None:
        assert torch.equal(a.policy_mask, b.policy_mask)
    assert (a.routed_experts is None) == (b.routed_experts is None)
    if a.routed_experts is not None:
        assert a.routed_experts.dtype == b.routed_experts.dtype and torch.equal(a.routed_experts, b.routed_experts)


def test_round_trip_is_exact_for_text_image_video_and_multi_turn_items():
    items = _items()
    back = unpack_items(pickle.loads(pickle.dumps(pack_items(items))))
    assert len(back) == len(items)
    for a, b in zip(items, back):
        _same(a, b)
    assert unpack_items(pack_items([])) == []


def test_unpacked_tensors_own_their_storage_and_the_originals_are_untouched():
    items = _items()
    packed = pack_items(items)
    back = unpack_items(packed)
    one = back[1].vision["pixel_values"]
    assert one.untyped_storage().nbytes() == one.numel() * one.element_size()  # not a view of the flat tensor
    back[1].token["action_log_probs"].add_(1.0)
    assert not torch.equal(back[1].token["action_log_probs"], items[1].token["action_log_probs"])
    _same(items[1], unpack_items(packed)[1])  # neither the items nor the packed form changed


def test_every_field_of_a_train_item_travels():
    """A field added to TrainItem must be packed too (or this fails, rather than the field being dropped)."""
    from dataclasses import fields

    from mmrlhf.experience import wire

    assert {f.name for f in fields(TrainItem)} == {"prompt_ids", "response_ids", "policy_mask", "routed_experts",
                                                   *wire._DICTS}


def test_items_that_disagree_on_a_dtype_are_refused_by_name():
    items = _items()
    items[1].token["advantages"] = items[1].token["advantages"].float()
    with pytest.raises(ValueError, match=r"token\['advantages'\]"):
        pack_items(items)


def test_a_damaged_packed_form_is_refused():
    packed = pack_items(_items())
    key = ("token", "loss_mask")
    packed.flat[key] = packed.flat[key][:-1]
    with pytest.raises(ValueError, match="loss_mask"):
        unpack_items(packed)
