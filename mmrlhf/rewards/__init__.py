"""Rewards: rule functions, user plugins, local reward models, remote reward servers, and per-label recipes.

Modules, each with one job:

- ``types``: ``RewardBatch`` (input), ``RewardResult`` (output), ``SourceScores`` (one source's answer).
- ``plugins``: the reward-function contract: sync/async calls, output checking.
- ``runners``: which thread a synchronous function runs on (a bounded pool, or the main thread), off the loop.
- ``rules`` / ``math_accuracy``: built-in rule rewards (format checks, matching, math-verify accuracy);
  ``agent``: trajectory-aware rewards of tool-using rollouts (tool bonus gated on correctness, DeepEyes-style).
- ``functions``: the reward-function registry (the built-ins listed by name) and loading a function by name.
- ``local_model``: torch reward models (e.g. Qwen-VL backbone + scalar head), moved to the device only to score
  (or kept there, when served); ``text_model``: the same, tokenizing text and images with its own processor.
- ``wire`` / ``remote`` / ``server``: the HTTP protocol, its client (retries, batching) and its server;
  ``coalesce``: merges a served model's concurrent requests into one batch.
- ``sources``: the uniform source interface and the ``type`` -> builder registry.
- ``engine``: ``RewardComputationEngine`` (recipes, filtering, scatter-back, failure policy, metrics).

See docs/rewards.md.
"""

from mmrlhf.rewards.engine import RewardComputationEngine
from mmrlhf.rewards.functions import REWARD_FUNCTIONS, load_reward_function
from mmrlhf.rewards.remote import RemoteRewardClient, RemoteRewardError
from mmrlhf.rewards.sources import SOURCE_TYPES, FunctionSource, RewardSource, build_source
from mmrlhf.rewards.types import RewardBatch, RewardError, RewardInputError, RewardResult, SourceScores

__all__ = [
    "REWARD_FUNCTIONS",
    "SOURCE_TYPES",
    "FunctionSource",
    "RewardBatch",
    "RewardComputationEngine",
    "RewardError",
    "RemoteRewardClient",
    "RemoteRewardError",
    "RewardInputError",
    "RewardResult",
    "RewardSource",
    "SourceScores",
    "build_source",
    "load_reward_function",
]
