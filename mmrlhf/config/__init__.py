"""Typed configuration: ``load_config(path, overrides)`` -> frozen :class:`MMRLHFConfig`."""

from mmrlhf.config.agent import AgentConfig, ToolEntry
from mmrlhf.config.algorithm import AlgorithmConfig
from mmrlhf.config.base import Section
from mmrlhf.config.data import DataConfig
from mmrlhf.config.loader import ConfigError, apply_overrides, build_config, dump_config, load_config
from mmrlhf.config.model import ModelConfig
from mmrlhf.config.reward import RewardConfig
from mmrlhf.config.rollout import RolloutConfig
from mmrlhf.config.schema import MMRLHFConfig
from mmrlhf.config.trainer import TrainerConfig

__all__ = [
    "AgentConfig",
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "MMRLHFConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "Section",
    "ToolEntry",
    "TrainerConfig",
    "apply_overrides",
    "build_config",
    "dump_config",
    "load_config",
]
