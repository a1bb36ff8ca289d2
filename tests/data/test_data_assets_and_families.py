"""The shipped sample data goes through the whole pipeline; Qwen2.5-VL videos keep their own temporal spacing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from data_testing import solid_image

from mmrlhf.config.data import DataConfig
from mmrlhf.data import MultimodalDataProcessor, PromptDataset
from mmrlhf.models.adapters import get_adapter
from mmrlhf.testing.tiny_models import FAMILIES, tiny_model_dir

SAMPLE = Path(__file__).resolve().parents[2] / "assets" / "data" / "sample_prompts.jsonl"


def test_sample_prompts_load_and_process(make_processor):
    ds = PromptDataset(str(SAMPLE), DataConfig())
    out = make_processor().process_records(list(ds), 2)
    per_prompt = list(zip(out.all_images_num[::2], out.all_labels[::2], out.all_references[::2]))
    assert per_prompt == [(len(r.images), r.label, r.reference) for r in ds]
    chat = out.all_prompts[-1]
    assert chat.index("Answer with one word.") < chat.index("<|vision_start|>")  # the system turn comes first
    # the loaded pixels are the shipped file's
    from PIL import Image

    with Image.open(SAMPLE.parent / "red_square.png") as im:
        assert out.all_images[2][0].tobytes() == im.convert("RGB").tobytes()


@pytest.fixture(scope="session")
def qwen25():
    from transformers import AutoProcessor

    path = tiny_model_dir("qwen2_5_vl", "tiny", seed=0)
    return AutoProcessor.from_pretrained(path), get_adapter(path)


def test_qwen25_video_time_spacing_per_sample(qwen25):
    hf, adapter = qwen25
    proc = MultimodalDataProcessor(hf, 1024, adapter)
    fast = {"video": [solid_image(seed=k) for k in range(4)], "fps": 4.0}
    slow = {"video": [solid_image(seed=k) for k in range(4)], "fps": 1.0}
    out = proc.process_multimodal_batch(["<video>a", "<image>b", "<video><video>c"],
                                        [None, solid_image(), None], n_samples_per_prompt=2,
                                        all_videos=[[fast], None, [slow, fast]])
    t = adapter.temporal_patch_size
    assert torch.allclose(out.all_vision_inputs[0]["second_per_grid_ts"], torch.tensor([t / 4.0]))
    assert "second_per_grid_ts" not in out.all_vision_inputs[2]
    assert torch.allclose(out.all_vision_inputs[5]["second_per_grid_ts"], torch.tensor([t / 1.0, t / 4.0]))
    # vLLM's input for this family carries the sampling metadata
    video = out.all_videos[4][0]
    frames, meta = adapter.vllm_video(video.as_thwc().numpy(), video.fps, video.frame_indices)
    assert frames.shape[0] == meta["total_num_frames"] == len(video.frame_indices)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_processing_alone(family):
    """Per family: each sample's ids and pixel slices equal the HF processor run on that prompt alone."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    path = tiny_model_dir(family, "tiny", seed=0)
    hf, adapter = AutoProcessor.from_pretrained(path), get_adapter(path)
    side = adapter.patch_size * adapter.spatial_merge_size * 2
    clip = {"video": [solid_image((side, side), seed=k) for k in range(4)], "fps": 2.0}
    prompts = ["plain", "<image>one", "<image><image>two", "<video>clip", "<image> and <video>"]
    images = [None, solid_image((side, side)), [solid_image((side, 2 * side), 1), solid_image((side, side), 2)],
              None, solid_image((2 * side, side), 3)]
    videos = [None, None, None, clip, clip]
    out = MultimodalDataProcessor(hf, 1024, adapter).process_multimodal_batch(
        prompts, images, n_samples_per_prompt=2, all_videos=videos)
    merge = adapter.spatial_merge_size ** 2
    for k in range(0, len(out), 2):
        kwargs = {"text": [out.all_prompts[k]], "add_special_tokens": False}
        if out.all_images[k]:
            kwargs["images"] = out.all_images[k]
        if out.all_videos[k]:
            kwargs["videos"] = [v.frames for v in out.all_videos[k]]
            kwargs["do_sample_frames"] = False
            kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(v.frames), fps=v.fps,
                                                      frames_indices=list(range(len(v.frames))))
                                        for v in out.all_videos[k]]
        alone = hf(**kwargs)
        assert out.all_prompt_token_ids[k] == list(alone["input_ids"][0]) == out.all_prompt_token_ids[k + 1]
        for key in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw"):
            assert (key in alone) == (key in out.all_vision_inputs[k])
            if key in alone:
                assert torch.equal(out.all_vision_inputs[k][key], alone[key])
        for token, key in ((adapter.image_token_id, "image_grid_thw"), (adapter.video_token_id, "video_grid_thw")):
            want = int(alone[key].prod(-1).sum()) // merge if key in alone else 0
            assert out.all_prompt_token_ids[k].count(token) == want
