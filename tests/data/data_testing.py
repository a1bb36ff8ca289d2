"""Media helpers for the data-pipeline tests (a uniquely named module: tests/ has no packages)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def solid_image(size=(56, 56), seed=0) -> Image.Image:
    """A random-noise RGB image (noise, so that different seeds give different pixel values)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def write_video(path, frames=6, size=(56, 56), fps=4, seed=0) -> str:
    """Write a small mpeg4 video with PyAV; returns its path as a string."""
    from mmrlhf.testing.published_data import write_video as write

    return str(write(Path(path), frames=frames, size=size, fps=fps, seed=seed))
