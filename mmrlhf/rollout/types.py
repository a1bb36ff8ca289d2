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
    ``request_id`` is the caller's name for the prompt (e.g. the dataset record id): engine errors and skip reasons
    name it, so a bad record can be found without mapping batch positions back by hand.
    """

    prompt: str
    prompt_token_ids: list[int] | None = None
    images: list[Any] = field(default_factory=list)  # PIL images, in placeholder order
    videos: list[Any] = field(default_factory=list)  # [T, H, W, 3] uint8 frame arrays
    video_fps: float | list[float] = 2.0  # one value for all videos, or one per video
    vision_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # processor tensors of this prompt
    mm_token_type_ids: list[int] | None = None  # per prompt token: 0 text, 1 image pad, 2 video pad
    request_id: str | None = None  # the caller's record id, named in errors and skip reasons
    # The request's own seed: sample j draws from seed + j, whatever the call's other requests and its
    # SamplingSettings.seed (a multiple of n leaves room for the children: :func:`request_seed` makes one). None: the
    # call's seed and the request's index decide (SamplingSettings). Why: a caller whose requests go to the engine
    # in varying batches (an agent's turns) keeps each sample's stream its own.
    seed: int | None = None

    def fps_of(self, i: int) -> float:
        return float(self.video_fps[i] if isinstance(self.video_fps, (list, tuple)) else self.video_fps)


def request_name(requests: list[GenerationRequest], index: int) -> str:
    """How errors and skip reasons name a request: its record id when the caller gave one, and its position."""
    rid = requests[index].request_id
    return f"record {rid!r} (request {index})" if rid is not None else f"request {index}"


@dataclass(frozen=True)
class SamplingSettings:
    """Engine-independent sampling parameters (mapped onto vLLM ``SamplingParams`` or the transformers engine's
    own sampler). Both engines sample from exactly this distribution and nothing else: the logits with the
    forbidden tokens (and, before ``min_new_tokens``, the stop tokens) removed, divided by ``temperature``, cut by
    ``min_p``, then ``top_k``, then ``top_p``. A checkpoint's ``generation_config.json`` sampling defaults
    (repetition penalty, top-k, ...) are never applied.

    ``seed``: sample ``j`` of request ``i`` draws from its own stream, seeded ``stream_seed(seed, i, j, n)`` =
    ``request_seed(seed, i, n) + j`` where the request seed is a hash of ``(seed, i)`` times ``n``: no two samples of
    one call share random numbers, a sample does not depend on how the batch was split, and nearby seeds (1 and 2)
    give unrelated streams rather than the same streams shifted by one. A caller making several calls passes a new
    seed per call (the experience maker uses ``mix_seed(base, call)``). ``None``: fresh, unreproducible randomness.
    """

    n: int = 1  # completions per request
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0  # 0 = off (applied after the temperature, before top-k)
    max_new_tokens: int = 1024
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # sample j of request i uses stream_seed(seed, i, j, n) (see the class docstring)
    logprobs: bool = True  # return the sampled tokens' log-probs (of the distribution they were drawn from)
    forbidden_token_ids: tuple[int, ...] = ()  # never sampled, in addition to the family's vision special tokens


_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 62-bit seed that depends on every part through a SplitMix64 chain: inputs that differ by one give
    unrelated outputs (so run seeds 1 and 2, or calls 7 and 8, never share streams)."""
    x = 0
    for part in parts:
        x = (x ^ (int(part) & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x >> 2


# Mixed into the run's seed for the sampling seed of a rank (or rollout actor) > 0: no other stream of the run, and no
# rank of another run seed, draws from it.
RANK_STREAM = 0x72616E6B  # "rank"
# How a rank's sampling seed derives from ``rollout.seed``: ``mixed`` (:func:`rank_seed`), or ``offset``
# (``seed + rank``), the scheme of the checkpoints written before the mixed one, which a run resumed from one keeps.
RANK_SEED_SCHEMES = ("mixed", "offset")  # the current one first


def rank_seed(seed: int, rank: int, scheme: str = RANK_SEED_SCHEMES[0]) -> int:
    """The sampling seed of training rank (or Ray rollout actor) ``rank`` of a run seeded ``seed``.

    ``mixed``: rank 0 keeps ``seed`` (a one-process run, and its checkpoints, are what they were, and rank 0 of
    torchrun samples as one process does), a rank r > 0 draws from ``mix_seed(seed, RANK_STREAM, r)``: unrelated
    to every other rank's and to every seed a user picks. ``offset``: ``seed + rank``, under which rank 1 of seed s
    drew rank 0's stream of seed s + 1 (kept only for a run resumed from a checkpoint written that way)."""
    if scheme not in RANK_SEED_SCHEMES:
        raise ValueError(f"unknown rank-seed scheme {scheme!r}; valid: {', '.join(RANK_SEED_SCHEMES)}")
    if not rank:
        return int(seed)
    return int(seed) + int(rank) if scheme == "offset" else mix_seed(seed, RANK_STREAM, rank)


def request_seed(seed: int, request_index: int, n: int) -> int:
    """Seed of request ``request_index``: a multiple of ``n``, so its samples ``+ 0 .. n-1`` (vLLM seeds the j-th
    child of a request with ``request seed + j``) never reach another request's."""
    return (mix_seed(seed, request_index) % ((1 << 62) // max(n, 1))) * n


def seed_of(request: GenerationRequest, settings: SamplingSettings, index: int) -> int | None:
    """The seed of request ``index`` of a call (its sample ``j`` draws from it ``+ j``): the request's own
    (:attr:`GenerationRequest.seed`) where the caller set one, else :func:`request_seed` of the call's seed (``None``:
    the call is unseeded)."""
    if request.seed is not None:
        return int(request.seed)
    return None if settings.seed is None else request_seed(settings.seed, index, settings.n)


def stream_seed(seed: int, request_index: int, sample_index: int, n: int) -> int:
    """The seed of sample ``sample_index`` of request ``request_index`` (see :class:`SamplingSettings`)."""
    return request_seed(seed, request_index, n) + sample_index


@dataclass
class Completion:
    token_ids: list[int]
    # Log-prob of each sampled token under the distribution it was sampled from: the policy's logits with the
    # forbidden tokens (and stop tokens before min_new_tokens) removed, divided by the temperature, renormalised
    # over the min-p / top-k / top-p set (vLLM's "processed_logprobs"). Greedy decoding: no temperature, no truncation.
    logprobs: list[float] | None
    finish_reason: str  # "stop" (EOS / stop string) or "length" (hit max_new_tokens)
    # rollout.routing_replay (mixture-of-experts models, vLLM engine): the experts each token was routed to,
    # [prompt + response - 1, num_hidden_layers, top_k] int (every token the engine ran; -1 where none); else None
    routed_experts: Any = None
    # rollout.partial (a segmented generation, mmrlhf.rollout.partial): per response token the policy version that
    # sampled it; None: one generation, every token of the version the engine held
    token_versions: list[int] | None = None

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


class RequestRejectedError(ValueError):
    """The engine rejected one request for a reason other than its length (e.g. more images than the engine's
    per-prompt limit); the message names the request."""
