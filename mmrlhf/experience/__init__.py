"""Experience types and makers."""

from mmrlhf.experience.base import ExperienceMaker
from mmrlhf.experience.types import Experience, ExperienceVL

__all__ = ["Experience", "ExperienceMaker", "ExperienceVL"]
