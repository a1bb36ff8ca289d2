"""Shared pieces of the experience-maker tests: a mixed multimodal batch and a recording reward function."""

from __future__ import annotations

from PIL import Image

from mmrlhf.rewards.engine import RewardComputationEngine
from mmrlhf.rewards.sources import FunctionSource


def mixed_batch():
    """Text-only, one image, three images, one video, image + video (the issue's mixed batch)."""
    red, blue = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (84, 56), (0, 0, 255))
    green = Image.new("RGB", (56, 84), (0, 255, 0))
    frames = [Image.new("RGB", (56, 56), (40 * t, 0, 0)) for t in range(4)]
    prompts = ["Describe the picture in one sentence.", "<image>What color is the square?",
               "<image><image><image>Which image is red?", "<video>What happens in the video?",
               "<image><video>Is the image in the video?"]
    images = [None, [red], [red, blue, green], None, [blue]]
    videos = [None, None, None, [frames], [frames]]
    references = ["a", "red", "1", "nothing", "no"]
    labels = ["caption", "colour", "colour", "video", "video"]
    return prompts, images, videos, references, labels


class RecordingReward:
    """Reward = response length parity (varies within groups); records what it was given."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, responses, prompts, labels, references, **extra):
        self.calls.append({"responses": list(responses), "prompts": list(prompts), "labels": list(labels)})
        return [float(len(r) % 2) for r in responses]


def reward_engine(fn) -> RewardComputationEngine:
    return RewardComputationEngine({"parity": FunctionSource(fn, name="parity")}, {}, default_recipe=[("parity", 1.0)])
