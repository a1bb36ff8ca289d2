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
