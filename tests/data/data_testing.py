"""Media helpers for the data-pipeline tests (a uniquely named module: tests/ has no packages)."""

from __future__ import annotations

import numpy as np
from PIL import Image


def solid_image(size=(56, 56), seed=0) -> Image.Image:
    """A random-noise RGB image (noise, so that different seeds give different pixel values)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def write_video(path, frames=6, size=(56, 56), fps=4, seed=0) -> str:
    """Write a small mpeg4 video with PyAV; returns its path as a string."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        container.start_encoding()  # writes the header even when no frame follows (the zero-frame case)
        for _ in range(frames):
            array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)
