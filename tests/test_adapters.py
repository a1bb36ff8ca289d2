"""Family adapters: facts come from the model config (never a literal merge factor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrlhf.models.adapters import ADAPTERS, Qwen2VLAdapter, get_adapter
from mmrlhf.registry import RegistryError


def _config(model_type: str, merge: int) -> dict:
    return {"model_type": model_type, "image_token_id": 11, "video_token_id": 12, "vision_start_token_id": 13,
            "vision_end_token_id": 14,
            "vision_config": {"spatial_merge_size": merge, "temporal_patch_size": 2, "patch_size": 14}}


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_tokens_per_grid_uses_the_configured_merge_size(merge):
    adapter = get_adapter(_config("qwen2_vl", merge))
    grid = torch.tensor([[1, 6, 6], [2, 6, 12]])
    assert adapter.tokens_per_grid(grid).tolist() == [36 // merge**2, 144 // merge**2]


def test_family_selection_and_errors(tiny_qwen2_vl, tiny_qwen2_5_vl):
    assert isinstance(get_adapter(tiny_qwen2_vl), Qwen2VLAdapter)
    assert get_adapter(tiny_qwen2_5_vl).family == "qwen2_5_vl"
    assert set(ADAPTERS) >= {"qwen2_vl", "qwen2_5_vl"}
    with pytest.raises(ValueError, match="no model-family adapter for model_type 'llama'"):
        get_adapter(_config("llama", 2))
    with pytest.raises(RegistryError, match="unknown model family"):
        get_adapter(_config("qwen2_vl", 2), family="qwen9")
    missing = _config("qwen2_vl", 2)
    del missing["video_token_id"]
    with pytest.raises(ValueError, match="video_token_id"):
        get_adapter(missing)


def test_vllm_video_metadata_only_where_needed():
    frames = np.zeros((6, 28, 28, 3), dtype=np.uint8)
    assert get_adapter(_config("qwen2_vl", 2)).vllm_video(frames, fps=2.0) is frames
    wrapped, meta = get_adapter(_config("qwen2_5_vl", 2)).vllm_video(frames, fps=2.0)
    assert wrapped is frames
    assert meta["total_num_frames"] == 6 and meta["duration"] == 3.0 and meta["frames_indices"] == list(range(6))
    assert get_adapter(_config("qwen2_vl", 2)).vision_special_token_ids() == [11, 12, 13, 14]


def test_engine_prompt_ids_collapse_pad_runs():
    adapter = get_adapter(_config("qwen2_vl", 2))
    ids = [1, 13, 11, 11, 11, 14, 13, 11, 11, 14, 13, 12, 12, 12, 14, 2]
    assert adapter.engine_prompt_ids(ids) == [1, 13, 11, 14, 13, 11, 14, 13, 12, 14, 2]
    assert adapter.engine_prompt_ids([5, 6]) == [5, 6]
    qwen3 = get_adapter(_config("qwen3_vl", 2))
    assert qwen3.engine_prompt_ids(ids) is None  # video expansion carries timestamps: send text instead
    assert qwen3.engine_prompt_ids([13, 11, 11, 14]) == [13, 11, 14]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mm_token_type_ids_match_the_processor_for_lists_and_tensors(family):
    """One rule for the token types (data processor, sample builder, scalar-head reward model): the adapter's,
    equal to what the family's HF processor returns, for images and videos."""
    from PIL import Image
    from transformers import AutoProcessor

    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir(family)
    processor, adapter = AutoProcessor.from_pretrained(path), get_adapter(path)
    frames = [np.full((56, 56, 3), 40 * t, dtype=np.uint8) for t in range(4)]
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "video"}, {"type": "text", "text": "What is shown?"}]}],
        add_generation_prompt=True, tokenize=False)
    kwargs = {"video_metadata": [{"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}]}
    out = processor(text=[text], images=[Image.new("RGB", (56, 56), (255, 0, 0))], videos=[frames],
                    return_tensors="pt", do_sample_frames=False, **kwargs)
    ids, expected = out["input_ids"], out["mm_token_type_ids"]  # [1, S]
    assert set(expected.unique().tolist()) == {0, 1, 2}
    assert torch.equal(adapter.mm_token_type_ids(ids), expected)
    assert adapter.mm_token_type_ids(ids[0].tolist()) == expected[0].tolist()
