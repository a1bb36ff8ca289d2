"""Shared fixtures for the data-pipeline tests: the tiny processor, its adapter, and media written to tmp dirs."""

from __future__ import annotations

import pytest
from data_testing import solid_image, write_video

from mmrlhf.config.data import DataConfig
from mmrlhf.data import MultimodalDataProcessor
from mmrlhf.models.adapters import get_adapter
from mmrlhf.testing.tiny_models import tiny_model_dir


@pytest.fixture(scope="session")
def model_dir():
    return tiny_model_dir("qwen2_vl", "tiny", seed=0)


@pytest.fixture(scope="session")
def hf_processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def adapter(model_dir):
    return get_adapter(model_dir)


@pytest.fixture(scope="session")
def make_processor(hf_processor, adapter):
    """``make_processor(**data_config_fields)`` -> a MultimodalDataProcessor over the tiny model."""

    def build(prompt_max_len: int = 1024, **fields) -> MultimodalDataProcessor:
        cfg = DataConfig(prompt_max_len=prompt_max_len, **fields)
        return MultimodalDataProcessor(hf_processor, prompt_max_len, adapter, data_config=cfg)

    return build


@pytest.fixture
def media(tmp_path):
    """A few files in a tmp dir: two images, one video, a corrupt image, a corrupt video, a zero-frame video."""
    paths = {}
    for k in range(2):
        p = tmp_path / f"img{k}.png"
        solid_image(seed=10 + k).save(p)
        paths[f"img{k}"] = str(p)
    paths["video"] = write_video(tmp_path / "clip.mp4", frames=6, seed=3)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    paths["broken_png"] = str(tmp_path / "broken.png")
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 garbage")
    paths["broken_mp4"] = str(tmp_path / "broken.mp4")
    paths["empty_mp4"] = write_video(tmp_path / "empty.mp4", frames=0, seed=4)
    paths["dir"] = str(tmp_path)
    return paths
