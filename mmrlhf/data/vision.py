"""Image and video loading: every accepted input form -> RGB PIL image or a :class:`LoadedVideo`, with guard rails.

Why our own loader rather than ``qwen_vl_utils.fetch_image`` / ``fetch_video`` end to end: those silently fall back
to another video reader on a decode error, assume a merge size of 2, fetch URLs from the network and give errors
that name neither the record nor the file. We keep their *semantics* (``smart_resize`` from qwen-vl-utils for the
pixel bounds, fps / nframes / min / max frame sampling as in ``smart_nframes``, a total-pixel budget per video as in
``fetch_video``) and add what a training run needs:
a pixel limit checked from the header before decoding (decompression bombs), zero-frame videos rejected, and
every failure raised as a :class:`DataError` naming the file, for the caller to name the record and apply the
error / skip policy. The resize factor (patch size x spatial merge size) and the temporal factor come from the
model's family adapter, never from constants.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from PIL import Image
from qwen_vl_utils.vision_process import IMAGE_MIN_TOKEN_NUM, MAX_RATIO, smart_resize

from mmrlhf.data.errors import DataError
from mmrlhf.data.types import LoadedVideo


@dataclass(frozen=True)
class VisionSettings:
    """Loader knobs (dataset level; an item given as a dict may override the pixel / frame ones)."""

    resize_factor: int  # patch_size * spatial_merge_size of the model: sides are resized to multiples of it
    temporal_factor: int  # temporal_patch_size: frame counts are padded to multiples of it
    image_min_pixels: Optional[int] = None
    image_max_pixels: Optional[int] = None
    image_pixel_limit: int = 50_000_000
    video_fps: float = 2.0
    video_nframes: Optional[int] = None
    video_min_frames: int = 4
    video_max_frames: int = 64
    video_min_pixels: Optional[int] = None
    video_max_pixels: Optional[int] = None
    video_max_tokens: Optional[int] = 512  # total budget of one video, in vision tokens (None: no budget)
    video_total_pixels: Optional[int] = None  # the same budget in pixels (a per-item override; wins when set)

    @classmethod
    def from_config(cls, data_cfg: Any, adapter: Any) -> "VisionSettings":
        """Build from a :class:`~mmrlhf.config.data.DataConfig` and a model-family adapter."""
        names = ("image_min_pixels", "image_max_pixels", "image_pixel_limit", "video_fps", "video_nframes",
                 "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels", "video_max_tokens")
        return cls(resize_factor=adapter.patch_size * adapter.spatial_merge_size,
                   temporal_factor=adapter.temporal_patch_size,
                   **{n: getattr(data_cfg, n) for n in names})


class VisionLoader:
    """Loads images and videos under one :class:`VisionSettings`. Stateless apart from the settings."""

    def __init__(self, settings: VisionSettings) -> None:
        self.settings = settings

    # ---- images ---------------------------------------------------------------------------------------------
    def load_image(self, item: Any, base_dir: Optional[str] = None) -> Image.Image:
        """``item``: path, ``file://`` path, bytes, base64 / data URI string, PIL image, ``{"bytes": .., "path": ..}``
        (how ``datasets`` stores images) or ``{"image": <any of those>, "min_pixels": .., "max_pixels": ..}``."""
        s = self.settings
        lo, hi = s.image_min_pixels, s.image_max_pixels
        if isinstance(item, dict) and "image" in item:
            lo, hi = item.get("min_pixels", lo), item.get("max_pixels", hi)
            item = item["image"]
        image, name = self._open_image(item, base_dir)
        image = self._decode(image, name)
        return _resize_image(image, s.resize_factor, lo, hi, name)

    def _open_image(self, item: Any, base_dir: Optional[str]) -> tuple[Image.Image, str]:
        """Open lazily (header only) so the pixel limit is checked before any decoding."""
        if isinstance(item, Image.Image):
            return item, "<PIL image>"
        if isinstance(item, dict) and ("bytes" in item or "path" in item):
            if item.get("bytes") is not None:
                return self._open_bytes(item["bytes"], item.get("path") or "<bytes>")
            item = item.get("path")
        if isinstance(item, (bytes, bytearray, memoryview)):
            return self._open_bytes(bytes(item), "<bytes>")
        if isinstance(item, (str, Path)):
            text = str(item)
            if text.startswith("data:"):
                return self._open_bytes(_b64decode(text.split(",", 1)[-1], "<data URI>"), "<data URI>")
            path = resolve_path(text, base_dir)
            if path is not None:
                return self._open_path(path)
            raw = _maybe_base64(text)
            if raw is not None:
                return self._open_bytes(raw, "<base64>")
            if text.startswith(("http://", "https://")):
                raise DataError("URLs are not fetched at run time; download the file and give its path",
                                reason="missing_file", file=text)
            raise DataError(f"image file not found (looked for {searched_paths(text, base_dir)})",
                            reason="missing_file", file=text)
        raise DataError(f"unsupported image input of type {type(item).__name__}", reason="bad_image", file="<?>")

    def _open_path(self, path: str) -> tuple[Image.Image, str]:
        return self._open(path, path), path

    def _open_bytes(self, data: bytes, name: str) -> tuple[Image.Image, str]:
        return self._open(io.BytesIO(data), name), name

    def _open(self, source: Any, name: str) -> Image.Image:
        try:
            image = Image.open(source)
        except Image.DecompressionBombError as exc:  # PIL's own (larger) limit, if ours was raised above it
            raise DataError(f"refusing to decode: {exc}", reason="image_too_large", file=name) from exc
        except (OSError, SyntaxError, ValueError) as exc:
            raise DataError(f"unreadable image: {exc}", reason="corrupt_image", file=name) from exc
        try:
            return self._checked(image, name)
        except DataError:
            image.close()
            raise

    def _checked(self, image: Image.Image, name: str) -> Image.Image:
        w, h = image.size
        if w * h > self.settings.image_pixel_limit:
            raise DataError(f"image is {w}x{h} = {w * h} pixels, above data.image_pixel_limit "
                            f"({self.settings.image_pixel_limit}); refusing to decode it",
                            reason="image_too_large", file=name)
        if w == 0 or h == 0:
            raise DataError(f"image has zero size {w}x{h}", reason="corrupt_image", file=name)
        _check_aspect(w, h, name, "bad_image")
        return image

    def _decode(self, image: Image.Image, name: str) -> Image.Image:
        self._checked(image, name)
        try:
            image.load()
            return _to_rgb(image)
        except (OSError, SyntaxError, ValueError) as exc:
            raise DataError(f"unreadable image: {exc}", reason="corrupt_image", file=name) from exc

    # ---- videos ---------------------------------------------------------------------------------------------
    def load_video(self, item: Any, base_dir: Optional[str] = None) -> LoadedVideo:
        """``item``: a video file path, a list of frame images (any image form), or ``{"video": <either>, "fps":
        .., "nframes": .., "min_frames": .., "max_frames": .., "min_pixels": .., "max_pixels": .., "total_pixels": ..,
        "max_tokens": ..}``. A frame list is taken as sampled at ``fps``."""
        s = self.settings
        if isinstance(item, dict) and "video" in item:
            s = replace(s, video_fps=item.get("fps", s.video_fps), video_nframes=item.get("nframes", s.video_nframes),
                        video_min_frames=item.get("min_frames", s.video_min_frames),
                        video_max_frames=item.get("max_frames", s.video_max_frames),
                        video_min_pixels=item.get("min_pixels", s.video_min_pixels),
                        video_max_pixels=item.get("max_pixels", s.video_max_pixels),
                        video_max_tokens=item.get("max_tokens", s.video_max_tokens),
                        video_total_pixels=item.get("total_pixels", s.video_total_pixels))
            item = item["video"]
        if isinstance(item, (list, tuple)):
            frames, fps, indices, name = self._frames_from_images(item, base_dir, s)
        elif isinstance(item, (str, Path)):
            frames, fps, indices, name = self._frames_from_file(str(item), base_dir, s)
        else:
            raise DataError(f"unsupported video input of type {type(item).__name__}", reason="bad_video", file="<?>")
        frames, indices = _pad_frames(frames, indices, s.temporal_factor)
        lo, hi = _frame_pixel_bounds(frames.shape[0], s)
        frames = _resize_frames(frames, s.resize_factor, lo, hi, name)
        return LoadedVideo(frames=frames, fps=fps, frame_indices=indices, source=name)

    def _frames_from_file(self, text: str, base_dir: Optional[str], s: VisionSettings):
        path = resolve_path(text, base_dir)
        if path is None:
            raise DataError(f"video file not found (looked for {searched_paths(text, base_dir)})",
                            reason="missing_file", file=text)
        import decord

        try:
            reader = decord.VideoReader(path, num_threads=1)
            total = len(reader)
            src_fps = float(reader.get_avg_fps() or 0.0)
        except Exception as exc:  # decord raises its own DECORDError (a RuntimeError) or others
            if _has_no_frames(path):
                raise DataError("video has zero frames (no decodable video stream)", reason="empty_video",
                                file=path) from exc
            raise DataError(f"unreadable video: {exc}", reason="corrupt_video", file=path) from exc
        if total <= 0:
            raise DataError("video has zero frames", reason="empty_video", file=path)
        if src_fps <= 0:
            src_fps = s.video_fps  # no timing information: take frames as if sampled at the target rate
        n = _frame_count(total, src_fps, s)
        indices = torch.linspace(0, total - 1, n).round().long().tolist()
        try:
            array = reader.get_batch(indices).asnumpy()  # [T, H, W, 3] uint8
        except Exception as exc:
            raise DataError(f"unreadable video frames: {exc}", reason="corrupt_video", file=path) from exc
        if array.shape[0] == 0:
            raise DataError("video decoded to zero frames", reason="empty_video", file=path)
        _check_aspect(array.shape[2], array.shape[1], path, "bad_video")
        frames = torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()
        return frames, n / total * src_fps, indices, path

    def _frames_from_images(self, items: Any, base_dir: Optional[str], s: VisionSettings):
        name = "<frame list>"
        if len(items) == 0:
            raise DataError("video has zero frames", reason="empty_video", file=name)
        # A frame list is taken whole (its frames are already chosen) unless nframes / max_frames say otherwise;
        # its frames are taken as sampled at ``video_fps``, so keeping n of them keeps n / len of that rate (the
        # model's temporal positions and Qwen3-VL's timestamps follow the frames kept).
        if s.video_nframes is not None:
            n = _frame_count(len(items), s.video_fps, s)
        else:
            n = min(len(items), s.video_max_frames)
        indices = torch.linspace(0, len(items) - 1, n).round().long().tolist()
        images = [self._decode(*self._open_image(items[i], base_dir)) for i in indices]  # only the sampled frames
        size = images[0].size
        arrays = [_as_array(im if im.size == size else im.resize(size)) for im in images]
        frames = torch.stack([torch.from_numpy(a) for a in arrays]).permute(0, 3, 1, 2)
        return frames.contiguous(), s.video_fps * n / len(items), indices, name


def _check_aspect(w: int, h: int, name: str, reason: str) -> None:
    """Qwen-VL processors reject aspect ratios above qwen-vl-utils' MAX_RATIO: say so here, naming the file."""
    if max(w, h) > MAX_RATIO * min(w, h):
        raise DataError(f"{w}x{h} has an aspect ratio above {MAX_RATIO}, which Qwen-VL processors reject",
                        reason=reason, file=name)


def _has_no_frames(path: str) -> bool:
    """True for a well-formed container without a single video frame (decord only says "cannot find stream").

    PyAV tells the two failures apart: it opens an empty container but not a corrupt one."""
    try:
        import av

        with av.open(path) as container:
            if not container.streams.video:
                return True
            return next(iter(container.decode(video=0)), None) is None
    except Exception:
        return False


def _frame_count(total: int, src_fps: float, s: VisionSettings) -> int:
    """Frames to sample, ``smart_nframes`` style: a fixed ``nframes`` or ``fps`` clamped to [min, max] frames."""
    if s.video_nframes is not None:
        n = s.video_nframes
    else:
        n = max(s.video_min_frames, math.floor(total / src_fps * s.video_fps))
    return max(1, min(n, s.video_max_frames, total))


def _frame_pixel_bounds(n_frames: int, s: VisionSettings) -> tuple[Optional[int], Optional[int]]:
    """Per-frame (min, max) pixels of a video of ``n_frames`` frames (after temporal padding).

    With a total budget, qwen-vl-utils' rule: every temporal patch (``temporal_factor`` frames, one slice of the
    vision grid) gets an equal share of the budget, so the video costs at most ``budget / factor^2`` tokens whatever
    its frame count; the per-frame maximum still applies, and a share below the per-frame minimum is raised to it
    (the budget then gives way: too many frames for it)."""
    lo, hi = s.video_min_pixels, s.video_max_pixels
    budget = s.video_total_pixels
    if budget is None and s.video_max_tokens is not None:
        budget = s.video_max_tokens * s.resize_factor**2
    if budget is None:
        return lo, hi
    if lo is None:
        lo = IMAGE_MIN_TOKEN_NUM * s.resize_factor**2  # what smart_resize assumes when given no minimum
    share = budget * s.temporal_factor // max(n_frames, 1)
    hi = share if hi is None else min(hi, share)
    return lo, max(hi, lo)


def _pad_frames(frames: torch.Tensor, indices: list[int], factor: int) -> tuple[torch.Tensor, list[int]]:
    """Repeat the last frame up to a multiple of the temporal patch size, so the grid and vLLM agree exactly."""
    extra = (-frames.shape[0]) % factor
    if extra:
        frames = torch.cat([frames, frames[-1:].expand(extra, *frames.shape[1:])], dim=0)
        indices = indices + [indices[-1]] * extra
    return frames, indices


def _resize_image(image: Image.Image, factor: int, lo: Optional[int], hi: Optional[int], name: str) -> Image.Image:
    if lo is None and hi is None:
        return image
    w, h = image.size
    try:
        new_h, new_w = smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
    except (ValueError, AssertionError) as exc:
        raise DataError(f"cannot resize image {w}x{h}: {exc}", reason="bad_image", file=name) from exc
    return image if (new_w, new_h) == (w, h) else image.resize((new_w, new_h), Image.Resampling.BICUBIC)


def _resize_frames(frames: torch.Tensor, factor: int, lo: Optional[int], hi: Optional[int], name: str) -> torch.Tensor:
    if lo is None and hi is None:
        return frames
    h, w = frames.shape[-2:]
    try:
        new_h, new_w = smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
    except (ValueError, AssertionError) as exc:
        raise DataError(f"cannot resize video {w}x{h}: {exc}", reason="bad_video", file=name) from exc
    if (new_h, new_w) == (h, w):
        return frames
    from torchvision.transforms.v2 import functional as TF

    return TF.resize(frames, [new_h, new_w], antialias=True)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, compositing any transparency onto white (as qwen-vl-utils does for RGBA)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.split()[3])
        return out
    return image.convert("RGB")


def _as_array(image: Image.Image):
    import numpy as np

    return np.array(image, dtype=np.uint8)  # a writable copy (torch.from_numpy warns on read-only arrays)


def searched_paths(text: str, base_dir: Optional[str]) -> str:
    """The resolved absolute path(s) :func:`resolve_path` tried for ``text``, for a not-found message."""
    if text.startswith("file://"):
        text = text[len("file://"):]
    if len(text) > 4096 or "\n" in text:
        return "<not a path>"
    if os.path.isabs(text) or base_dir is None:
        return os.path.abspath(text)
    return " and ".join(dict.fromkeys([os.path.abspath(os.path.join(base_dir, text)), os.path.abspath(text)]))


def resolve_path(text: str, base_dir: Optional[str]) -> Optional[str]:
    """An existing file for ``text`` (absolute, ``file://``, cwd-relative or ``base_dir``-relative), else None."""
    if text.startswith("file://"):
        text = text[len("file://"):]
    if len(text) > 4096 or "\n" in text:
        return None
    if os.path.isabs(text) or base_dir is None:
        return text if os.path.isfile(text) else None
    joined = os.path.join(base_dir, text)
    if os.path.isfile(joined):
        return joined
    return text if os.path.isfile(text) else None


def _maybe_base64(text: str) -> Optional[bytes]:
    """Bytes if ``text`` is plausibly base64 (long enough and strictly decodable), else None.

    Tried only after no file matched: a path has a ``.`` (not in the base64 alphabet) or is short."""
    if len(text) < 64:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _b64decode(text: str, name: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DataError(f"invalid base64 image data: {exc}", reason="corrupt_image", file=name) from exc
