"""``model``: which policy to load and how."""

from __future__ import annotations

from typing import Literal

from mmrlhf.config.base import Section


class ModelConfig(Section):
    """Read by the model builders (actor, reference) and the rollout engine."""

    pretrain: str = ""
    """Local path (or hub id, if the user's machine reaches a hub) of the policy model; empty until set."""
    family: Literal["auto", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"] = "auto"
    """Model-family adapter to use; ``auto`` reads ``model_type`` from the model's config."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype of the actor and reference models."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel for transformers forwards (``flash_attention_2`` needs a GPU and the flash-attn package)."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code (off: only transformers' built-in families)."""
    reference: str = ""
    """Path of the reference (initial) policy; empty means the same weights as ``pretrain``."""
    critic: str = ""
    """Path of the model whose decoder initialises the PPO critic (a zero-initialised value head is added); empty
    means ``pretrain``. Only read when the advantage estimator needs values (``gae``)."""
