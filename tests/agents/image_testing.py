"""Helpers for the agent tests: images whose every pixel is different, so a crop's pixels name its region."""

from __future__ import annotations

import numpy as np
from PIL import Image


def pattern(width: int, height: int) -> Image.Image:
    """An RGB image whose pixel (x, y) is (x % 256, y % 256, (x // 256) * 16 + (y // 256)): unique per pixel for
    images up to 4096 pixels a side."""
    xs, ys = np.meshgrid(np.arange(width), np.arange(height))  # (height, width) each
    rgb = np.stack([xs % 256, ys % 256, (xs // 256) * 16 + ys // 256], axis=-1).astype(np.uint8)  # (H, W, 3)
    return Image.fromarray(rgb, "RGB")
