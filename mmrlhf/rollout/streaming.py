"""A rollout engine as a stream: requests go in one at a time, whenever the caller has one ready, and come back as
each finishes. The asynchronous agent loop (:mod:`mmrlhf.agents.async_loop`) runs every trajectory on its own this
way: a turn is sent the moment its observation is ready, not when the step's slowest tool returns.

Two kinds:

- an engine with a continuous batch (vLLM, :class:`~mmrlhf.rollout.vllm_stream.VLLMStream`): a request joins the
  running batch at the engine's next step and leaves it when it ends, so the engine keeps generating for whichever
  trajectories are ready while the others wait on their tools;
- any other engine (the transformers engine, a test's scripted engine): :class:`BatchedStream` generates what is
  queued when the caller steps it, one ``generate`` call per distinct sampling setting. Correct and reproducible,
  but the requests queued together wait for the longest of them (the transformers engine has no continuous batch).

Either way a request carries its own seed (:attr:`~mmrlhf.rollout.types.GenerationRequest.seed`), so what it
samples does not depend on which other requests shared its engine steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Protocol

from mmrlhf.rollout.types import GenerationOutput, GenerationRequest, SamplingSettings


@dataclass
class Finished:
    """A streamed request that ended: its output (the request's ``n`` completions), or why it was skipped."""

    key: Hashable  # the caller's name for the request (given to ``submit``)
    output: GenerationOutput | None  # None when skipped
    skipped: str | None = None  # the reason (a prompt that does not fit the context)


class Stream(Protocol):
    """What the agent loop needs of an engine to run trajectories independently."""

    continuous: bool  # True: requests finish one by one as the engine runs (see the module docstring)

    def submit(self, key: Hashable, request: GenerationRequest, settings: SamplingSettings) -> None:
        """Queue ``request`` (generated with ``settings``) under ``key``."""
        ...

    def step(self) -> list[Finished]:
        """Run the engine once (one batched step, or every queued request) and return what finished."""
        ...

    @property
    def busy(self) -> bool:
        """Whether a submitted request has not come back from :meth:`step` yet."""
        ...

    def close(self) -> None:
        """Drop every request still running (an error or an interrupt left them behind)."""
        ...


class BatchedStream:
    """The stream of an engine without a continuous batch: :meth:`step` generates everything queued, one
    ``generate`` call per distinct :class:`SamplingSettings` (the engine takes one setting per call)."""

    continuous = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._queued: list[tuple[Hashable, GenerationRequest, SamplingSettings]] = []

    def submit(self, key: Hashable, request: GenerationRequest, settings: SamplingSettings) -> None:
        self._queued.append((key, request, settings))

    @property
    def busy(self) -> bool:
        return bool(self._queued)

    def step(self) -> list[Finished]:
        queued, self._queued = self._queued, []
        by_settings: dict[SamplingSettings, list[tuple[Hashable, GenerationRequest]]] = {}
        for key, request, settings in queued:
            by_settings.setdefault(settings, []).append((key, request))
        finished: list[Finished] = []
        for settings, items in by_settings.items():
            result = self.engine.generate([request for _, request in items], settings)
            finished += [Finished(items[out.request_index][0], out) for out in result.outputs]
            finished += [Finished(items[i][0], None, reason) for i, reason in result.skipped.items()]
        return finished

    def close(self) -> None:
        self._queued = []


def open_stream(engine: Any) -> Stream:
    """``engine``'s own stream where it has one (``engine.open_stream()``), else a :class:`BatchedStream`."""
    opener = getattr(engine, "open_stream", None)
    stream = opener() if callable(opener) else None
    return stream if stream is not None else BatchedStream(engine)


def continuous(engine: Any) -> bool:
    """Whether ``engine`` keeps a continuous batch (its stream finishes requests one by one)."""
    return open_stream(engine).continuous


def auto_loop(engine: Any) -> tuple[str, str]:
    """``agent.loop: auto`` over ``engine``: ``("async" | "lockstep", why)``, the one place that decides it.

    ``async`` where the engine keeps a continuous batch AND its stream has run on this kind of machine: an engine
    that can say so has a ``stream_proof()`` (the vLLM engine: its stream drives vLLM's engine core request by
    request, exercised by the suite on vLLM's CPU platform in-process, elsewhere only once ``mmrlhf doctor --gpu``
    compared it with lockstep there, :meth:`~mmrlhf.rollout.vllm_engine.VLLMEngine.stream_proof`). An engine
    without one that streams is taken at its word. Everything else runs lockstep, which needs nothing but
    ``generate``."""
    if not continuous(engine):
        return "lockstep", "the engine keeps no continuous batch: the asynchronous loop would gain nothing"
    proof = getattr(engine, "stream_proof", None)
    if not callable(proof):
        return "async", "the engine streams requests into a continuous batch"
    proven, why = proof()
    return ("async" if proven else "lockstep"), why
