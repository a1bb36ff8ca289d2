"""Config -> engine. The only place that reads the ``rollout`` section to build an engine; engines themselves take
plain arguments."""

from __future__ import annotations

from typing import Any

from mmrlhf.config.rollout import RolloutConfig
from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.base import RolloutEngine
from mmrlhf.rollout.types import SamplingSettings


def sampling_settings(cfg: RolloutConfig, *, n: int | None = None, forbidden: list[int] = ()) -> SamplingSettings:
    """The rollout section's sampling knobs as engine-independent settings."""
    return SamplingSettings(
        n=cfg.n_samples_per_prompt if n is None else n, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, min_p=cfg.min_p, max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
        stop=tuple(cfg.stop), seed=cfg.seed, logprobs=True, forbidden_token_ids=tuple(forbidden),
    )


def engine_seed(seed: int) -> int:
    """The seed the vLLM engine is built with: vLLM seeds NumPy with it, which takes 32 bits, while a rank's sampling
    seed has 62 (:func:`~mmrlhf.rollout.types.rank_seed`). Seeded samples do not depend on it: each draws from its
    own seed (or, per step, the call's), which keeps every bit."""
    return int(seed) % (1 << 32)


def build_engine(cfg: RolloutConfig, model_path: str, *, family: str = "auto", hf_model: Any = None,
                 tokenizer: Any = None, trust_remote_code: bool = False, lora_rank: int = 0,
                 lora_vision: bool = False,
                 hf_compute_dtype: Any = None, images_per_prompt: int | None = None) -> RolloutEngine:
    """Build the configured engine. The transformers engine needs the (actor) model and tokenizer.

    The vLLM engine's precision is ``cfg.dtype`` (never the trainer's ``model.dtype``: an fp32 trainer must not
    make the engine fp32 on a GPU). The transformers engine shares the actor's module and so its precision:
    ``hf_compute_dtype`` (the actor's autocast dtype, with float32 master parameters) or else the parameters' dtype;
    a ``cfg.dtype`` that says otherwise is an error rather than silently ignored. ``lora_rank`` > 0 builds the vLLM
    engine with its LoRA support on (``model.lora.sync=vllm_lora``; ``lora_vision``: its tower / connector LoRA too,
    for ``model.lora.vision``). ``images_per_prompt``: the most images one
    request may carry (multi-turn trajectories: ``agent.max_images``), raising ``limit_images_per_prompt``.
    """
    adapter = get_adapter(model_path, family)
    if cfg.engine == "vllm":
        from mmrlhf.rollout.vllm_engine import VLLMEngine
        from mmrlhf.rollout.vllm_setup import cuda_available

        limits = {k: v for k, v in (("image", cfg.limit_images_per_prompt), ("video", cfg.limit_videos_per_prompt))
                  if v is not None}
        if images_per_prompt is not None:  # multi-turn: the prompt's images and every tool image of a trajectory
            limits["image"] = max(limits.get("image", 0), int(images_per_prompt))
        return VLLMEngine(
            model_path, adapter, max_model_len=cfg.max_model_len, prompt_too_long=cfg.prompt_too_long,
            limit_mm_per_prompt=limits or None, trust_remote_code=trust_remote_code,
            weight_sync_bucket_mb=cfg.weight_sync_bucket_mb, dtype=cfg.dtype, seed=engine_seed(cfg.seed),
            tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager, enable_sleep=cfg.enable_sleep, lora_rank=lora_rank,
            lora_vision=lora_vision, sleep_level=cfg.sleep_level, seed_mode=cfg.resolved_seed_mode(cuda_available()),
            routing_replay=cfg.routing_replay,
        )
    if hf_model is None or tokenizer is None:
        raise ValueError("rollout.engine=transformers needs the actor model and its tokenizer")
    model_dtype = str(hf_compute_dtype or next(hf_model.parameters()).dtype).removeprefix("torch.")
    if cfg.dtype not in ("auto", model_dtype):
        raise ValueError(f"rollout.dtype={cfg.dtype} but rollout.engine=transformers generates with the actor's "
                         f"own {model_dtype} module: set rollout.dtype to auto (or {model_dtype}), or use vLLM")
    from mmrlhf.rollout.hf_engine import HFGenerateEngine

    return HFGenerateEngine(
        hf_model, adapter, eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer, max_model_len=cfg.max_model_len,
        prompt_too_long=cfg.prompt_too_long,
        batch_size=cfg.micro_rollout_batch_size, weight_sync_bucket_mb=cfg.weight_sync_bucket_mb,
        compute_dtype=hf_compute_dtype,
    )
