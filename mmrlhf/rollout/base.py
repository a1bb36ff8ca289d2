"""The rollout-engine interface and the helpers every engine shares."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Iterable, Iterator, Sequence

import torch

from mmrlhf.rollout.types import (
    GenerationRequest,
    GenerationResult,
    PromptTooLongError,
    SamplingSettings,
    request_name,
)

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]

# What a sleeping engine can wake separately (vLLM's memory-pool tags): its weights, then its KV cache. Waking the
# weights alone is enough to load new ones, so the trainer's memory and the engine's KV cache never peak together.
WAKE_WEIGHTS: tuple[str, ...] = ("weights",)
WAKE_KV_CACHE: tuple[str, ...] = ("kv_cache",)
SLEEP_TAGS: tuple[str, ...] = WAKE_WEIGHTS + WAKE_KV_CACHE


class RolloutEngine(ABC):
    """Generates completions for multimodal prompts and accepts new policy weights.

    Engines are created by :func:`mmrlhf.rollout.builder.build_engine` from plain arguments; they never see the
    config tree. ``update_weights`` takes an iterator of ``(name, tensor)`` in transformers' parameter naming so a
    trainer in this process, a Ray actor or a LoRA merge can all feed it.
    """

    supports_sleep: bool = False
    # Whether sleep discards the weights instead of offloading them (vLLM sleep level 2): the next sync must then
    # carry every weight, frozen ones included, since nothing else restores them.
    sleep_discards_weights: bool = False

    def __init__(self, max_model_len: int, prompt_too_long: str = "skip") -> None:
        if prompt_too_long not in ("skip", "error"):
            raise ValueError(f"prompt_too_long must be 'skip' or 'error', got {prompt_too_long!r}")
        self.max_model_len = max_model_len
        self.prompt_too_long = prompt_too_long

    @abstractmethod
    def generate(self, requests: list[GenerationRequest], settings: SamplingSettings) -> GenerationResult:
        """Generate ``settings.n`` completions for every request; too-long prompts are skipped or raise."""

    @abstractmethod
    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Load new weights; returns the number of tensors loaded."""

    def sleep(self) -> None:
        """Release accelerator memory between rollouts (no-op where unsupported)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep` (no-op where unsupported): everything (``tags=None``) or only the named parts of
        :data:`SLEEP_TAGS` (e.g. :data:`WAKE_WEIGHTS` before a weight sync, :data:`WAKE_KV_CACHE` after it)."""

    def close(self) -> None:
        """Free the engine's resources."""

    # ---- shared helpers -----------------------------------------------------------------------------------
    def split_too_long(self, requests: list[GenerationRequest], settings: SamplingSettings) -> dict[int, str]:
        """Indices of prompts that leave no room for ``max(1, min_new_tokens)`` new tokens, with the reason.

        Raises :class:`PromptTooLongError` naming the first such request when the policy is ``error``; skip reasons
        name the request too (its ``request_id`` when given).
        """
        room = max(1, settings.min_new_tokens)
        skipped: dict[int, str] = {}
        for i, req in enumerate(requests):
            if req.prompt_token_ids is None:
                continue
            n = len(req.prompt_token_ids)
            if n + room > self.max_model_len:
                reason = f"{request_name(requests, i)}: prompt of {n} tokens + {room} new > max_model_len " \
                         f"{self.max_model_len}"
                if self.prompt_too_long == "error":
                    raise PromptTooLongError(reason)
                skipped[i] = reason
        if skipped:
            logger.warning("skipping %d of %d prompts that do not fit the context (%s)",
                           len(skipped), len(requests), next(iter(skipped.values())))
        return skipped


def iter_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a tensor larger than the bound
    travels alone), so a weight update never holds more than one bucket of copies at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def forbidden_token_ids(adapter: Any, settings: SamplingSettings) -> list[int]:
    """Every token a response must not contain: the family's vision special tokens (sampling one breaks the next
    forward) together with the caller's ``forbidden_token_ids``; a caller's list adds to the vision tokens, it
    never replaces them."""
    return sorted({*map(int, adapter.vision_special_token_ids()), *map(int, settings.forbidden_token_ids)})


def stop_token_ids(model: object, eos_token_id: int, extra: Iterable[int] = ()) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS, the model's generation-config EOS ids (real Qwen models
    list two) and any configured stop ids. Engines and sample builders use the same set."""
    ids = {int(eos_token_id), *map(int, extra)}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(map(int, gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return sorted(ids)
