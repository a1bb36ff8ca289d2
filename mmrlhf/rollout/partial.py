"""Partial rollouts: generation in segments, so a weight update that arrives while a batch is generated is applied
at the next segment boundary instead of waiting for the batch's longest answer (``rollout.partial``).

Why segments: an engine call cannot take new weights half way, and throwing the unfinished answers away wastes what
they cost. Here every call asks for at most ``segment_tokens`` new tokens; between calls the caller's
:class:`VersionGate` applies whatever weights arrived and says which policy version the next segment runs under;
the unfinished completions then continue from their own tokens (prompt + response so far, sent as token ids with the
same images and videos), so nothing generated is lost. The engine recomputes the continuation's prefix under the new
weights, so every token is exactly a sample of the version that produced it: token ``t`` of a response is drawn from
``pi_v(. | prompt, response[:t])`` where ``v`` is its entry in ``Completion.token_versions``, and the log-prob the
engine reports for it is that distribution's.

Seeds: segment 0 is the caller's call unchanged; a continuation segment ``s`` draws from ``mix_seed(seed, s)``, one
stream per continued completion (its position among the continued ones, in request then sample order; a request
that carries its own seed: sample ``j`` continues from ``mix_seed(request seed + j, s)``), so the
tokens depend only on the seeds, the weights of each segment and where the versions changed: a checkpoint that
records the versions per segment (:attr:`SegmentedResult.segment_versions`) regenerates the same tokens
(``replay``).

What is refused: stop strings (a string that straddles a segment boundary would not be matched) and engines that
report routed experts (a continuation's routing would only cover its own segment); see
:func:`check_continuable` for prompts whose ids the engine cannot take.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from mmrlhf.rollout.types import (
    Completion,
    GenerationOutput,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    mix_seed,
    request_name,
)

logger = logging.getLogger(__name__)


class VersionGate(Protocol):
    """What a segmented generation asks between segments (a rollout actor, :mod:`mmrlhf.launch.ray.holder`)."""

    def boundary(self, call: int, segment: int) -> int:
        """Apply the weights that arrived (or, replaying a checkpoint, the version it recorded for segment
        ``segment`` of engine call ``call``) and return the policy version that segment runs under."""


@dataclass
class SegmentedResult(GenerationResult):
    """A :class:`GenerationResult` whose completions carry ``token_versions``, with the version each segment ran
    under (``segment_versions[s]``: what a checkpoint records to regenerate it)."""

    segment_versions: list[int] = dataclasses.field(default_factory=list)


@dataclass
class _Open:
    """One completion being generated: where it came from and what it has so far."""

    request: int
    sample: int
    ids: list[int]
    logprobs: list[float] | None
    versions: list[int]
    finish: str = "length"


def check_continuable(requests: Sequence[GenerationRequest], engine_ids: Callable[[list[int]], Any],
                      settings: SamplingSettings) -> None:
    """Raise unless every request can be continued from token ids (``engine_ids``: the adapter's
    ``engine_prompt_ids``, None where a prompt can only be sent as text) and the settings have no stop strings."""
    if settings.stop:
        raise ValueError(f"rollout.partial: stop strings {list(settings.stop)} cannot be matched across segment "
                         "boundaries (EOS and stop token ids are); remove rollout.stop or set rollout.partial=false")
    for i, req in enumerate(requests):
        if req.prompt_token_ids is None or engine_ids(list(req.prompt_token_ids)) is None:
            raise ValueError(f"{request_name(requests, i)}: rollout.partial continues an answer from the prompt's "
                             "token ids, and this prompt can only be sent to the engine as text (e.g. a video "
                             "prompt of a family whose expansion interleaves timestamps); use rollout.partial=false")


def generate_in_segments(engine: Any, requests: list[GenerationRequest], settings: SamplingSettings, *,
                         segment_tokens: int, boundary: Callable[[int], int]) -> SegmentedResult:
    """``engine.generate(requests, settings)`` in segments of at most ``segment_tokens`` new tokens,
    ``boundary(segment)`` (the version gate: it may load new weights into ``engine``) asked before each; the result
    as the engine's would be (skips, outputs in request order), each completion with its per-token versions."""
    if segment_tokens < 1:
        raise ValueError(f"rollout.partial_segment_tokens must be >= 1, got {segment_tokens}")
    if getattr(engine, "routing_replay", "none") != "none":
        raise ValueError("rollout.partial with rollout.routing_replay: a continued answer's routing would cover its "
                         "last segment only; set one of them off")
    check_continuable(requests, engine.adapter.engine_prompt_ids, settings)
    versions = [boundary(0)]
    first = engine.generate(requests, _segment_settings(settings, 0, settings.n, segment_tokens, 0))
    seconds = first.seconds
    opened: list[_Open] = []
    prompts: dict[int, list[int]] = {}
    for out in first.outputs:
        prompts[out.request_index] = list(out.prompt_token_ids)
        for j, c in enumerate(out.completions):
            opened.append(_Open(out.request_index, j, list(c.token_ids), _copy(c.logprobs),
                                [versions[0]] * len(c.token_ids), c.finish_reason))
    segment = 0
    while True:
        live = [o for o in opened if _continues(o, settings, (segment + 1) * segment_tokens)]
        if not live:
            break
        segment += 1
        versions.append(boundary(segment))
        follow = [_continuation(requests[o.request], o, segment) for o in live]
        # every live completion filled each segment so far: they all hold segment * segment_tokens tokens
        result = engine.generate(follow, _segment_settings(settings, segment, 1, segment_tokens, len(live[0].ids)))
        seconds += result.seconds
        got = {out.request_index: out.completions[0] for out in result.outputs}
        for k, o in enumerate(live):
            c = got.get(k)
            if c is None:  # the engine refused the longer prompt: the answer ends here, cut by the length
                logger.warning("%s: its continuation was skipped (%s); the answer keeps its %d tokens",
                               request_name(requests, o.request), result.skipped.get(k, "no output"), len(o.ids))
                o.finish = "length_skipped"
                continue
            o.ids += list(c.token_ids)
            if o.logprobs is not None:
                o.logprobs = None if c.logprobs is None else o.logprobs + list(c.logprobs)
            o.versions += [versions[-1]] * len(c.token_ids)
            o.finish = c.finish_reason
    return SegmentedResult(outputs=_outputs(opened, prompts), skipped=dict(first.skipped), seconds=seconds,
                           segment_versions=versions)


def _continues(o: _Open, settings: SamplingSettings, filled: int) -> bool:
    """Whether the completion stopped only because its segment ended: the engine says "length", it holds
    ``filled`` tokens (every segment so far full; fewer means the context ended it) and the cap is not reached."""
    return o.finish == "length" and len(o.ids) == filled < settings.max_new_tokens


def _segment_settings(settings: SamplingSettings, segment: int, n: int, segment_tokens: int,
                      done: int) -> SamplingSettings:
    """Segment ``segment``'s settings, its completions holding ``done`` tokens each: ``n`` samples, at most
    ``segment_tokens`` new tokens, the minimum length left, and a seed of its own after the first."""
    cap = min(segment_tokens, settings.max_new_tokens - done)
    seed = settings.seed if segment == 0 or settings.seed is None else mix_seed(settings.seed, segment)
    return dataclasses.replace(settings, n=n, max_new_tokens=cap,
                               min_new_tokens=min(cap, max(0, settings.min_new_tokens - done)), seed=seed)


def _continuation(request: GenerationRequest, o: _Open, segment: int) -> GenerationRequest:
    """The completion so far as a prompt: the processor's prompt ids (vision pads expanded, what the engine takes as
    ids) and the response, with the prompt's images and videos (token types: the response's tokens are text). A
    request that carries its own seed continues from a stream of its sample's own: ``mix_seed(seed + j, segment)``."""
    types = None if request.mm_token_type_ids is None else list(request.mm_token_type_ids) + [0] * len(o.ids)
    seed = None if request.seed is None else mix_seed(int(request.seed) + o.sample, segment)
    return dataclasses.replace(request, prompt_token_ids=list(request.prompt_token_ids) + o.ids,
                               mm_token_type_ids=types, seed=seed,
                               request_id=f"{request.request_id if request.request_id is not None else o.request}"
                                          f"#{o.sample}")


def _outputs(opened: list[_Open], prompts: dict[int, list[int]]) -> list[GenerationOutput]:
    out: dict[int, GenerationOutput] = {}
    for o in opened:
        finish = "stop" if o.finish == "stop" else "length"
        out.setdefault(o.request, GenerationOutput(o.request, prompts[o.request], [])).completions.append(
            Completion(o.ids, o.logprobs, finish, token_versions=o.versions))
    return [out[i] for i in sorted(out)]


def _copy(values: list[float] | None) -> list[float] | None:
    return None if values is None else list(values)


class SegmentedEngine:
    """An engine whose :meth:`generate` runs in segments with ``gate`` asked between them (what a rollout actor with
    ``rollout.partial`` generates with); everything else (weights, sleep, attributes) is the wrapped engine's.
    ``calls`` collects each call's ``segment_versions`` (the rollout actor resets it per batch and puts it into the
    batch's metadata)."""

    def __init__(self, engine: Any, segment_tokens: int, gate: VersionGate) -> None:
        self.inner, self.segment_tokens, self.gate = engine, int(segment_tokens), gate
        self.calls: list[list[int]] = []  # per engine call since the owner last reset it: the segments' versions

    def generate(self, requests: list[GenerationRequest], settings: SamplingSettings) -> SegmentedResult:
        call = len(self.calls)
        result = generate_in_segments(self.inner, requests, settings, segment_tokens=self.segment_tokens,
                                      boundary=lambda segment: self.gate.boundary(call, segment))
        self.calls.append(result.segment_versions)
        return result

    def open_stream(self) -> None:
        """No continuous batch: a segmented call must see every segment boundary, so a streaming caller (the
        asynchronous agent loop) gets :class:`~mmrlhf.rollout.streaming.BatchedStream` over :meth:`generate`."""
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
