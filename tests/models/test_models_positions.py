"""M-RoPE positions: a packed sample's positions equal the positions the model computes for it alone."""

from __future__ import annotations

import pytest
import torch
from models_testing import PROMPT_ONLY_KEYS, batch_pieces

from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models.positions import packed_position_ids, padded_position_ids

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _built(bundle):
    prompts, responses, vision, inputs = batch_pieces(bundle)
    kw = dict(pad_id=0, eos_id=bundle.eos_id, adapter=bundle.adapter, vision=vision)
    return build_padded_samples(prompts, responses, **kw), build_packed_samples(prompts, responses, **kw), inputs


def _alone(bundle, sample_ids, inputs):
    """Positions the HF model itself derives for one unpadded sample (its compute_3d_position_ids)."""
    base = bundle.model.base_model
    base.rope_deltas = None
    ids = sample_ids[None]  # [1, L]
    extra = {k: v for k, v in inputs.items() if k not in PROMPT_ONLY_KEYS}
    types = torch.zeros_like(ids)
    types[:, : inputs["mm_token_type_ids"].shape[1]] = inputs["mm_token_type_ids"]
    pos = base.compute_3d_position_ids(
        input_ids=ids, inputs_embeds=None, image_grid_thw=extra.get("image_grid_thw"),
        video_grid_thw=extra.get("video_grid_thw"), attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
        past_key_values=None,
        **({"second_per_grid_ts": extra["second_per_grid_ts"]} if "second_per_grid_ts" in extra else {}),
    ) if ("image_grid_thw" in extra or "video_grid_thw" in extra) else None
    base.rope_deltas = None
    if pos is None:  # text only: the model uses plain positions
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    return pos[:, 0]  # [3, L]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_positions_equal_alone_and_padded(bundles, family):
    bundle = bundles[family]
    padded, packed, inputs = _built(bundle)
    pk = packed_position_ids(bundle.model, bundle.adapter, packed.samples, packed.vision_extra)  # [4, 1, T]
    pd = padded_position_ids(bundle.model, bundle.adapter, padded.samples, padded.vision_extra)  # [3, B, S]
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
        saw_vision |= not torch.equal(alone, torch.arange(n).expand(3, -1))
    assert saw_vision  # M-RoPE really differs from 1-D positions somewhere in this batch


def test_video_time_scale_is_carried(bundles):
    """Qwen2.5-VL video positions depend on second_per_grid_ts: dropping it must change them."""
    bundle = bundles["qwen2_5_vl"]
    _, packed, _ = _built(bundle)
    assert "second_per_grid_ts" in packed.vision_extra
    with_ts = packed_position_ids(bundle.model, bundle.adapter, packed.samples, packed.vision_extra)
    without = packed_position_ids(bundle.model, bundle.adapter, packed.samples, None)
    assert not torch.equal(with_ts, without)
