"""Vision loading: every accepted image form, qwen-vl-utils pixel bounds, video frame sampling, guard rails."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from data_testing import solid_image, write_video
from PIL import Image
from qwen_vl_utils.vision_process import fetch_image

from mmrlhf.config.data import DataConfig
from mmrlhf.data import DataError, VisionLoader, VisionSettings


@pytest.fixture
def loader(adapter):
    return VisionLoader(VisionSettings.from_config(DataConfig(), adapter))


def _png_bytes(image):
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_all_image_forms_decode_to_the_same_pixels(loader, tmp_path):
    image = solid_image((60, 40), seed=7)
    path = tmp_path / "a.png"
    image.save(path)
    raw = _png_bytes(image)
    b64 = base64.b64encode(raw).decode()
    forms = [str(path), path, f"file://{path}", "a.png", raw, b64, f"data:image/png;base64,{b64}", image,
             {"bytes": raw, "path": "a.png"}, {"bytes": None, "path": str(path)}, {"image": str(path)}]
    for form in forms:
        out = loader.load_image(form, base_dir=str(tmp_path))
        assert out.mode == "RGB" and out.tobytes() == image.tobytes(), repr(form)[:60]


def test_transparency_composited_on_white(loader):
    rgba = Image.new("RGBA", (28, 28), (255, 0, 0, 0))
    assert loader.load_image(rgba).getpixel((3, 3)) == (255, 255, 255)
    gray = Image.new("L", (28, 28), 77)
    assert loader.load_image(gray).getpixel((0, 0)) == (77, 77, 77)


@pytest.mark.parametrize("lo,hi,size", [(None, 56 * 56, (300, 200)), (112 * 112, None, (30, 40)),
                                        (28 * 28, 84 * 84, (99, 57))])
def test_pixel_bounds_follow_qwen_vl_utils(adapter, lo, hi, size):
    settings = VisionSettings.from_config(DataConfig(image_min_pixels=lo, image_max_pixels=hi), adapter)
    image = solid_image(size, seed=1)
    out = VisionLoader(settings).load_image(image)
    ele = {"image": image, **({"min_pixels": lo} if lo else {}), **({"max_pixels": hi} if hi else {})}
    ref = fetch_image(ele, image_patch_size=adapter.patch_size)
    assert out.size == ref.size
    factor = adapter.patch_size * adapter.spatial_merge_size
    assert out.size[0] % factor == 0 and out.size[1] % factor == 0


def test_per_item_bounds_override_dataset(adapter):
    settings = VisionSettings.from_config(DataConfig(image_max_pixels=224 * 224), adapter)
    image = solid_image((224, 224))
    loader = VisionLoader(settings)
    assert loader.load_image(image).size == (224, 224)
    small = loader.load_image({"image": image, "max_pixels": 56 * 56})
    assert small.size[0] * small.size[1] <= 56 * 56


def test_missing_corrupt_and_bomb_images(adapter, media, tmp_path):
    loader = VisionLoader(VisionSettings.from_config(DataConfig(image_pixel_limit=100 * 100), adapter))
    cases = [(str(tmp_path / "nope.png"), "missing_file", "nope.png"),
             (media["broken_png"], "corrupt_image", "broken.png"),
             (b"garbage bytes", "corrupt_image", "<bytes>"),
             ({"bytes": _png_bytes(solid_image((101, 100))), "path": "big.png"}, "image_too_large", "big.png"),
             ("https://example.com/a.png", "missing_file", "https://example.com/a.png"),
             ({"bytes": _png_bytes(solid_image((900, 4))), "path": "strip.png"}, "bad_image", "strip.png")]
    for item, reason, name in cases:
        with pytest.raises(DataError) as info:
            loader.load_image(item)
        assert info.value.reason == reason and name in str(info.value), str(info.value)


def test_bomb_is_refused_before_decoding(adapter, tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    solid_image((200, 150)).save(path)
    decoded = []
    original = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(1) or original(self))
    loader = VisionLoader(VisionSettings.from_config(DataConfig(image_pixel_limit=200 * 150 - 1), adapter))
    with pytest.raises(DataError, match="200x150"):
        loader.load_image(str(path))
    assert not decoded


def test_video_file_fps_sampling(loader, adapter, tmp_path):
    path = write_video(tmp_path / "v.mp4", frames=12, fps=4)  # 3 s
    video = loader.load_video({"video": path, "fps": 2.0, "min_frames": 1})  # 3 s x 2 fps = 6 frames
    assert video.frames.shape[0] == 6 and video.frames.dtype == torch.uint8
    assert video.frame_indices[0] == 0 and video.frame_indices[-1] == 11
    assert video.fps == pytest.approx(6 / 12 * 4)
    assert video.as_thwc().shape == (6, 56, 56, 3)


def test_video_nframes_max_frames_and_temporal_padding(adapter, tmp_path):
    path = write_video(tmp_path / "v.mp4", frames=9, fps=3)
    t = adapter.temporal_patch_size
    fixed = VisionLoader(VisionSettings.from_config(DataConfig(video_nframes=3), adapter)).load_video(path)
    assert fixed.frames.shape[0] % t == 0 and fixed.frames.shape[0] >= 3
    assert torch.equal(fixed.frames[-1], fixed.frames[2])  # padding repeats the last sampled frame
    capped = VisionLoader(VisionSettings.from_config(DataConfig(video_max_frames=4), adapter)).load_video(path)
    assert capped.frames.shape[0] == 4


def test_video_pixel_bounds(adapter, tmp_path):
    path = write_video(tmp_path / "v.mp4", frames=4, size=(112, 84), fps=2)
    settings = VisionSettings.from_config(DataConfig(video_max_pixels=56 * 56), adapter)
    video = VisionLoader(settings).load_video(path)
    h, w = video.frames.shape[-2:]
    factor = adapter.patch_size * adapter.spatial_merge_size
    assert h * w <= 56 * 56 and h % factor == 0 and w % factor == 0 and video.frames.dtype == torch.uint8


def test_video_from_frame_list(loader, tmp_path):
    frames = [solid_image(seed=s) for s in range(3)]
    frames[1].save(tmp_path / "f1.png")
    video = loader.load_video([frames[0], "f1.png", _png_bytes(frames[2])], base_dir=str(tmp_path))
    assert video.frames.shape[0] == 4  # 3 frames padded to the temporal patch size
    for k in range(3):
        assert torch.equal(video.frames[k].permute(1, 2, 0), torch.from_numpy(np.array(frames[k])))


def test_bad_videos(loader, media, tmp_path):
    cases = [(str(tmp_path / "nope.mp4"), "missing_file", "nope.mp4"),
             (media["broken_mp4"], "corrupt_video", "broken.mp4"),
             (media["empty_mp4"], "empty_video", "empty.mp4"),
             ([], "empty_video", "<frame list>")]
    for item, reason, name in cases:
        with pytest.raises(DataError) as info:
            loader.load_video(item)
        assert info.value.reason == reason and name in str(info.value), str(info.value)


# ---- the per-video pixel budget (data.video_max_tokens) -------------------------------------------------------------
# Released checkpoints' video processors: Qwen2-VL bounds each frame (shortest / longest edge in pixels per frame),
# Qwen3-VL the whole clip (pixels over all frames); neither sets the total cap, which makes transformers warn.
_RELEASED_VIDEO_SIZE = {"qwen2_vl": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384},
                        "qwen3_vl": {"shortest_edge": 4096, "longest_edge": 25165824}}


def _released_like(family):
    """The tiny model's processor, its video processor sized like the released checkpoint's (cap left unset)."""
    from transformers import AutoProcessor

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    processor.video_processor.size = dict(_RELEASED_VIDEO_SIZE[family])
    processor.video_processor.cap_pixels_per_frame = None
    return processor, get_adapter(path)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_default_budget_fits_a_720p_video_in_the_default_prompt(family):
    """20 frames of 1280x720: without a budget ~12,000 tokens (Qwen2-VL), refused under prompt_max_len 1024."""
    from mmrlhf.data import MultimodalDataProcessor

    processor, adapter = _released_like(family)
    cfg = DataConfig()
    frames = [Image.new("RGB", (1280, 720), (12 * t, 200 - 9 * t, 40)) for t in range(20)]
    proc = MultimodalDataProcessor.from_config(processor, adapter, cfg)
    out = proc.process_multimodal_batch(["<video>What happens in the video?"], all_videos=[[frames]])
    ids = out.all_prompt_token_ids[0]
    assert out.truncated == 0 and not out.skipped
    assert ids.count(adapter.video_token_id) <= cfg.video_max_tokens
    assert len(ids) + 256 <= cfg.prompt_max_len  # room for text (Qwen3-VL's frame timestamps included)
    video = out.all_videos[0][0]
    h, w = video.frames.shape[-2:]
    assert abs(w / h - 1280 / 720) < 0.2  # shrunk with the aspect ratio kept


def test_budget_follows_qwen_vl_utils(adapter):
    """Frame size under a total budget equals qwen-vl-utils' ``fetch_video`` for the same frames and budget, and the
    per-item ``total_pixels`` / ``max_tokens`` give the same result as the dataset-level key."""
    from qwen_vl_utils.vision_process import fetch_video

    factor = adapter.patch_size * adapter.spatial_merge_size
    frames = [solid_image((12 * factor, 7 * factor), seed=s) for s in range(8)]
    lo, tokens = 4 * factor**2, 32
    ref = fetch_video({"video": frames, "min_pixels": lo, "total_pixels": tokens * factor**2},
                      image_patch_size=adapter.patch_size)  # [T, 3, H, W]
    cfg = DataConfig(video_min_pixels=lo, video_max_tokens=tokens)
    by_config = VisionLoader(VisionSettings.from_config(cfg, adapter)).load_video(frames)
    plain = VisionLoader(VisionSettings.from_config(DataConfig(video_min_pixels=lo, video_max_tokens=None), adapter))
    by_item = plain.load_video({"video": frames, "total_pixels": tokens * factor**2})
    by_item_tokens = plain.load_video({"video": frames, "max_tokens": tokens})
    unbudgeted = plain.load_video(frames)
    assert tuple(ref.shape[-2:]) != tuple(unbudgeted.frames.shape[-2:])  # the budget bites here
    for video in (by_config, by_item, by_item_tokens):
        assert tuple(video.frames.shape[-2:]) == tuple(ref.shape[-2:])
        t, (h, w) = video.frames.shape[0], video.frames.shape[-2:]
        assert t // adapter.temporal_patch_size * (h // factor) * (w // factor) <= tokens


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_no_transformers_video_cap_warning(family):
    """Released video processors leave ``cap_pixels_per_frame`` unset and transformers warns on every run; the data
    processor must not (its loader already applied the budget). Control: the plain processor call does warn."""
    import logging

    from transformers.utils import logging as hf_logging
    from transformers.video_utils import VideoMetadata

    from mmrlhf.data import MultimodalDataProcessor

    processor, adapter = _released_like(family)
    frames = [solid_image((64, 64), seed=s) for s in range(4)]
    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Catch(level=logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)
    try:
        hf_logging.warning_once.cache_clear()  # a once-per-process warning: make it observable again
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}], tokenize=False)
        video = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in frames])  # [T, 3, H, W]
        meta = VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])
        processor(text=[text], videos=[video], do_sample_frames=False, video_metadata=[meta])
        assert any("cap_pixels_per_frame" in r.getMessage() for r in records)  # the control warns
        records.clear()
        hf_logging.warning_once.cache_clear()
        MultimodalDataProcessor(processor, 1024, adapter).process_multimodal_batch(["<video>x"], all_videos=[[frames]])
        assert [r.getMessage() for r in records] == []
    finally:
        logging.getLogger("transformers").removeHandler(handler)


def test_subsampled_frame_list_keeps_the_true_rate(adapter):
    """A frame list given at 4 fps and cut to 4 of its 8 frames is a 2 fps clip (nframes likewise)."""
    frames = [solid_image(seed=s) for s in range(8)]
    loader = VisionLoader(VisionSettings.from_config(DataConfig(), adapter))
    capped = loader.load_video({"video": frames, "fps": 4.0, "max_frames": 4})
    assert capped.frame_indices == [0, 2, 5, 7] and capped.fps == pytest.approx(2.0)
    fixed = loader.load_video({"video": frames, "fps": 4.0, "nframes": 2})
    assert fixed.fps == pytest.approx(1.0)
    whole = loader.load_video({"video": frames, "fps": 4.0})
    assert whole.fps == pytest.approx(4.0)


def test_subsampled_frame_list_gives_the_kept_frames_timestamps():
    """End to end on Qwen3-VL (its prompt carries frame timestamps): 8 frames at 4 fps cut to 4 must give the same
    prompt ids as those 4 frames given at 2 fps."""
    from transformers import AutoProcessor

    from mmrlhf.data import MultimodalDataProcessor
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir("qwen3_vl")
    proc = MultimodalDataProcessor(AutoProcessor.from_pretrained(path), 4096, get_adapter(path))
    frames = [solid_image((64, 64), seed=s) for s in range(8)]
    cut = proc.process_multimodal_batch(["<video>x"], all_videos=[{"video": frames, "fps": 4.0, "max_frames": 4}])
    kept = [frames[i] for i in cut.all_videos[0][0].frame_indices]
    direct = proc.process_multimodal_batch(["<video>x"], all_videos=[{"video": kept, "fps": 2.0}])
    assert cut.all_prompt_token_ids[0] == direct.all_prompt_token_ids[0]
    slow = proc.process_multimodal_batch(["<video>x"], all_videos=[{"video": kept, "fps": 4.0}])
    assert slow.all_prompt_token_ids[0] != direct.all_prompt_token_ids[0]  # control: timestamps follow the fps
