"""What goes into and comes out of a rollout engine (plain data; no engine objects)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GenerationRequest:
    """One prompt to generate from.

    ``prompt`` is the chat-templated text (vLLM re-tokenises it with the model's own processor); ``prompt_token_ids``
    are the ids the data processor produced (vision pad tokens expanded), used for length checks, for the
    transformers engine, and to verify that the engine saw exactly the prompt the trainer will score.
    """

    prompt: str
    prompt_token_ids: list[int] | None = None
    images: list[Any] = field(default_factory=list)  # PIL images, in placeholder order
    videos: list[Any] = field(default_factory=list)  # [T, H, W, 3] uint8 frame arrays
    video_fps: float | list[float] = 2.0  # one value for all videos, or one per video
    vision_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # processor tensors of this prompt
    mm_token_type_ids: list[int] | None = None  # per prompt token: 0 text, 1 image pad, 2 video pad


    def fps_of(self, i: int) -> float:
        return float(self.video_fps[i] if isinstance(self.video_fps, (list, tuple)) else self.video_fps)


@dataclass(frozen=True)
class SamplingSettings:
    """Engine-independent sampling parameters (mapped onto vLLM ``SamplingParams`` or HF ``generate``)."""

    n: int = 1  # completions per request
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 1024
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # request i uses seed + i (reproducible per request, independent of batching)
    logprobs: bool = True  # return the sampled tokens' log-probs
    forbidden_token_ids: tuple[int, ...] = ()  # never sampled (vision special tokens)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float] | None  # log-prob of each sampled token under the engine's policy
    finish_reason: str  # "stop" (EOS / stop string) or "length" (hit max_new_tokens)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class GenerationOutput:
    request_index: int  # position of the request in the input list
    prompt_token_ids: list[int]  # the ids the engine actually used
    completions: list[Completion]


@dataclass
class GenerationResult:
    outputs: list[GenerationOutput]  # generated requests, in input order
    skipped: dict[int, str] = field(default_factory=dict)  # request index -> reason (e.g. prompt too long)
    seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs for c in o.completions)


class PromptTooLongError(ValueError):
    """A prompt does not fit the engine's context and the policy is ``error``."""
