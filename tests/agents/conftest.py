"""Fixtures for the agent tests (image helpers live in image_testing.py, multi-turn samples in agent_testing.py)."""

from __future__ import annotations

import pytest
from image_testing import pattern
from PIL import Image


@pytest.fixture
def image_2000x1000() -> Image.Image:
    return pattern(2000, 1000)
