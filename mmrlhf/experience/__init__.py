"""Experience types and makers."""

from mmrlhf.experience.base import ExperienceMaker
from mmrlhf.experience.types import Experience, ExperienceVL, Samples, SamplesVL, split_vision_inputs

__all__ = ["Experience", "ExperienceMaker", "ExperienceVL", "Samples", "SamplesVL", "split_vision_inputs"]
