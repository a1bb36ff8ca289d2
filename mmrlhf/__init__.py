"""mmrlhf: reinforcement-learning fine-tuning for vision-language models.

Subpackages, each with one job:

- ``mmrlhf.config``: the typed configuration tree (YAML + dotted overrides, validated at load).
- ``mmrlhf.data``: prompt datasets, vision loading, ``MultimodalDataProcessor``.
- ``mmrlhf.rollout``: generation engines (vLLM in-process, transformers ``generate``).
- ``mmrlhf.experience``: ``Samples`` / ``Experience`` types and the experience makers.
- ``mmrlhf.models``: actor / critic wrappers and per-family adapters (Qwen2-VL, Qwen2.5-VL, ...).
- ``mmrlhf.rewards``: ``RewardComputationEngine``, rule rewards, local and remote reward models.
- ``mmrlhf.algorithms``: pure tensor math (advantages, KL, losses, shaping), registered by name.
- ``mmrlhf.testing``: offline tiny Qwen-VL model factory for tests, demos and benchmarks.
"""

__version__ = "0.1.0"
