"""M-RoPE positions: the engine's placement rule on hand-worked sequences, and both layouts (padded, packed) give
every sample the positions it has alone. (That the rule is the engine's is proven end to end, log-prob against
log-prob, in test_models_engine_parity.py.)"""

from __future__ import annotations

import pytest
import torch
from models_testing import batch_pieces

from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models.adapters import get_adapter
from mmrlhf.models.mrope import VisionUnit, batch_positions, sequence_positions
from mmrlhf.models.positions import packed_position_ids, padded_position_ids

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _config(model_type: str, **vision) -> dict:
    return {"model_type": model_type, "image_token_id": 11, "video_token_id": 12, "vision_start_token_id": 13,
            "vision_end_token_id": 14,
            "vision_config": {"spatial_merge_size": 2, "temporal_patch_size": 2, "patch_size": 14, **vision}}


def test_text_after_a_video_starts_one_past_its_largest_position():
    """2 text, a 3x1x2 video unit scaled by 2 in time (temporal 0, 2, 4), 2 text. transformers 5.19 restarts the
    text at 2 + max(h, w) = 4; the engine one past the largest vision position (2 + 4 = 6), i.e. 7."""
    types = torch.tensor([0, 0] + [2] * 6 + [0, 0])
    pos = sequence_positions(types, [], [VisionUnit(3, 1, 2, time_scale=2.0)])  # [3, 10]
    expected = torch.tensor([
        [0, 1, 2, 2, 4, 4, 6, 6, 7, 8],  # t
        [0, 1, 2, 2, 2, 2, 2, 2, 7, 8],  # h
        [0, 1, 2, 3, 2, 3, 2, 3, 7, 8],  # w
    ])
    assert torch.equal(pos, expected)


def test_fractional_time_scale_truncates_and_adjacent_units_follow_each_other():
    # Two images back to back (no text between), then a video scaled by 0.5 in time: temporal 0, 0, 1.
    types = torch.tensor([1] * 4 + [1] * 2 + [2] * 3 + [0])
    pos = sequence_positions(types, [VisionUnit(1, 2, 2), VisionUnit(1, 1, 2)], [VisionUnit(3, 1, 1, 0.5)])
    assert pos[:, :4].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]
    assert pos[:, 4:6].tolist() == [[2, 2], [2, 2], [2, 3]]  # second image one past the first's largest (1)
    assert pos[:, 6:9].tolist() == [[4, 4, 5], [4, 4, 4], [4, 4, 4]]  # video at 3 + 1; time 0, 0, 1
    assert pos[:, 9].tolist() == [6, 6, 6]


def test_family_layouts():
    """Qwen2.5-VL scales video time by tokens_per_second * second_per_grid_ts; Qwen2-VL by tokens_per_second
    alone (1 by default: the engine never reads its seconds); Qwen3-VL places a video frame by frame."""
    grid = torch.tensor([[3, 4, 6]])  # 3 temporal patches of 2x3 merged tokens
    q25 = get_adapter(_config("qwen2_5_vl", tokens_per_second=2))
    _, videos = q25.rope_units(None, grid, second_per_grid_ts=torch.tensor([0.75]))
    assert videos == [VisionUnit(3, 2, 3, 1.5)]
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 values for 1 videos"):
        q25.rope_units(None, grid, second_per_grid_ts=torch.tensor([0.75, 1.0]))
    q2 = get_adapter(_config("qwen2_vl"))
    assert q2.rope_units(None, grid, second_per_grid_ts=torch.tensor([0.75]))[1] == [VisionUnit(3, 2, 3, 1.0)]
    q3 = get_adapter(_config("qwen3_vl"))
    images, frames = q3.rope_units(torch.tensor([[1, 2, 2]]), grid)
    assert images == [VisionUnit(1, 1, 1)] and frames == [VisionUnit(1, 2, 3)] * 3


def test_padded_batch_and_mismatch_errors():
    adapter = get_adapter(_config("qwen2_vl"))
    # Row 0: left pad, text, one image (1x4x4 patches = 4 tokens), text. Row 1: text only.
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    ids = torch.where(types == 1, 11, 5)
    pos = adapter.rope_index(ids, types, image_grid_thw=torch.tensor([[1, 4, 4]]), attention_mask=mask)
    assert pos[:, 0].tolist() == [[0, 0, 1, 1, 1, 1, 3], [0, 0, 1, 1, 2, 2, 3], [0, 0, 1, 2, 1, 2, 3]]
    assert torch.equal(pos[:, 1], torch.arange(7).expand(3, -1))
    with pytest.raises(ValueError, match="row 0: .*4 image tokens at position 1 have no image grid left"):
        adapter.rope_index(ids, types, attention_mask=mask)
    with pytest.raises(ValueError, match="1 image grid.*left over"):
        adapter.rope_index(ids, types, image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 2]]), attention_mask=mask)
    with pytest.raises(ValueError, match=r"image grid \(16 tokens\) does not fit the run of 4 image tokens"):
        batch_positions(types, [VisionUnit(1, 4, 4)], [], mask)


def _built(bundle):
    prompts, responses, vision, inputs = batch_pieces(bundle)
    kw = dict(pad_id=0, eos_id=bundle.eos_id, adapter=bundle.adapter, vision=vision)
    return build_padded_samples(prompts, responses, **kw), build_packed_samples(prompts, responses, **kw), inputs


def _alone(bundle, sample_ids, inputs):
    """The adapter's positions for one unpadded sample, from the processor's own outputs for its prompt."""
    ids = sample_ids[None]  # [1, L]
    types = torch.zeros_like(ids)
    types[:, : inputs["mm_token_type_ids"].shape[1]] = inputs["mm_token_type_ids"]
    return bundle.adapter.rope_index(
        ids, types, image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=inputs.get("video_grid_thw"),
        second_per_grid_ts=inputs.get("second_per_grid_ts"),
    )[:, 0]  # [3, L]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_positions_equal_alone_and_padded(bundles, family):
    bundle = bundles[family]
    padded, packed, inputs = _built(bundle)
    pk = packed_position_ids(bundle.adapter, packed.samples, packed.vision_extra)  # [4, 1, T]
    pd = padded_position_ids(bundle.adapter, padded.samples, padded.vision_extra)  # [3, B, S]
    lens = packed.samples.packed_seq_lens.tolist()
    assert pk.shape == (4, 1, sum(lens)) and pd.shape == (3, *padded.samples.sequences.shape)
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    saw_vision = False
    for i, n in enumerate(lens):
        mine = pk[:, 0, starts[i] : starts[i] + n]  # [4, L_i]
        assert torch.equal(mine[0], torch.arange(n))  # text row restarts at each sample
        alone = _alone(bundle, packed.samples.sequences[0, starts[i] : starts[i] + n], inputs[i])
        assert torch.equal(mine[1:], alone), i
        row_mask = padded.samples.attention_mask[i].bool()
        assert torch.equal(pd[:, i, row_mask], alone), i
        assert (pd[:, i, ~row_mask] == 0).all()
        saw_vision |= not torch.equal(alone, torch.arange(n).expand(3, -1))
    assert saw_vision  # M-RoPE really differs from 1-D positions somewhere in this batch


def test_video_time_scale_is_carried(bundles):
    """Qwen2.5-VL video positions depend on second_per_grid_ts: another value must change them in both layouts."""
    bundle = bundles["qwen2_5_vl"]
    padded, packed, _ = _built(bundle)
    seconds = packed.vision_extra["second_per_grid_ts"]
    slower = {"second_per_grid_ts": seconds * 3}
    assert not torch.equal(packed_position_ids(bundle.adapter, packed.samples, packed.vision_extra),
                           packed_position_ids(bundle.adapter, packed.samples, slower))
    assert not torch.equal(padded_position_ids(bundle.adapter, padded.samples, padded.vision_extra),
                           padded_position_ids(bundle.adapter, padded.samples, slower))
