"""The experts a vLLM engine routed each token to (``rollout.routing_replay``), per sampled completion.

vLLM returns them itself (``enable_return_routed_experts``: ``CompletionOutput.routed_experts``, a
[prompt + response - 1, num_hidden_layers, top_k] array: every token the engine ran through the model; the last
sampled token never was), but only on its V2 model runner, which needs Triton: GPUs. There the engine is built with
that switch (:func:`routing_engine_kwargs`).

vLLM's CPU platform has no Triton, so there this module captures the same array itself (:class:`CpuRoutingCapture`):
every routed layer's ``BaseRouter`` calls a ``capture_fn`` with the step's top-k ids [tokens, k] (vLLM's own hook,
the one its capturer binds); after each model forward the step's rows are cut per request by the runner's
``query_start_loc`` and filed at the request's positions (``num_computed_tokens`` onwards). Each prompt must run
through the model for each of its samples, so prefix caching is switched off with it (on the CPU engine it is
off for recurrent models anyway, and a prefill costs little beside decoding). Works with the in-process engine
only (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the CPU default of ``scripts/env.sh``).

Both give the same layout, so everything downstream (samples, replay, metrics) reads one format.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

ROUTING_MODES = ("none", "record", "replay")


def routing_engine_kwargs(mode: str, device_type: str) -> dict[str, Any]:
    """Extra ``vllm.LLM`` arguments for ``rollout.routing_replay=mode`` on a ``device_type`` platform."""
    if mode not in ROUTING_MODES:
        raise ValueError(f"routing_replay must be one of {ROUTING_MODES}, got {mode!r}")
    if mode == "none":
        return {}
    if device_type == "cpu":
        return {"enable_prefix_caching": False}  # every sample's prompt must pass the captured routers
    # vLLM refuses its routed-experts output on the V1 runner; the variable must be set before the engine's config
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return {"enable_return_routed_experts": True}


class CpuRoutingCapture:
    """Per request id, the experts each of its tokens was routed to, captured in the in-process CPU engine.

    Install once after the engine is built (:meth:`install`), read with :meth:`take` after a ``generate``."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[int, np.ndarray]] = {}  # request id -> position -> [L, k]
        self._step: dict[int, torch.Tensor] = {}  # layer id -> [tokens, k] ids of the forward running now
        self.num_layers = 0
        self.top_k = 0

    def install(self, llm: Any) -> None:
        """Bind the capture into ``llm``'s (in-process) worker: a ``capture_fn`` on every routed layer's router and
        a wrapper around the model runner's forward that files each step's rows per request."""
        llm.collective_rpc(self._bind)
        if not self.num_layers:
            raise ValueError("routing capture: the engine's model has no routed-experts layer")

    def _bind(self, worker: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runner = worker.model_runner
        config = runner.model_config
        self.num_layers = int(config.get_total_num_hidden_layers())
        self.top_k = int(config.get_num_experts_per_tok())
        bound = 0
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner) and hasattr(module.router, "set_capture_fn"):
                module.router.set_capture_fn(self._capture_fn(int(module.layer_id)))
                bound += 1
        if not bound:
            self.num_layers = 0
            return
        forward = runner._model_forward

        def model_forward(*args: Any, **kwargs: Any) -> Any:
            self._step.clear()
            out = forward(*args, **kwargs)
            self._file(runner)
            return out

        runner._model_forward = model_forward

    def _capture_fn(self, layer: int):
        def capture(topk_ids: torch.Tensor) -> None:
            self._step[layer] = topk_ids.detach().to("cpu", torch.int16)

        return capture

    def _file(self, runner: Any) -> None:
        if not self._step:
            return
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1]  # [R + 1] rows of each request in this step
        computed = batch.num_computed_tokens_cpu[:num_reqs]  # [R] position of each request's first row
        tokens = int(starts[-1])
        step = np.full((tokens, self.num_layers, self.top_k), -1, dtype=np.int16)  # [T, L, k]
        for layer, ids in self._step.items():
            step[:, layer] = ids[:tokens].numpy()
        for r, req_id in enumerate(batch.req_ids[:num_reqs]):
            rows = self._rows.setdefault(req_id, {})
            for j in range(int(starts[r]), int(starts[r + 1])):
                rows[int(computed[r]) + j - int(starts[r])] = step[j]

    def take(self, request_id: str, num_tokens: int) -> np.ndarray:
        """[num_tokens, L, k] int16 routed experts of request ``request_id``'s first ``num_tokens`` tokens (-1
        where a token was not captured), forgetting the request."""
        rows = self._rows.pop(request_id, {})
        out = np.full((num_tokens, self.num_layers, self.top_k), -1, dtype=np.int16)
        for pos, row in rows.items():
            if pos < num_tokens:
                out[pos] = row
        return out

    def take_completion(self, request_id: str, index: int, n: int, num_tokens: int) -> np.ndarray:
        """:meth:`take` for completion ``index`` of the ``n`` of request ``request_id`` (a ``RequestOutput``'s id):
        the engine core runs completion j of a parallel-sampling request as ``"{j}_{id}"``, and the input processor
        appends a random ``-suffix`` to every id it hands the core."""
        name = f"{index}_{request_id}" if n > 1 else request_id
        found = [key for key in self._rows if key == name or key.rsplit("-", 1)[0] == name]
        if len(found) != 1:
            raise RuntimeError(f"routing capture: {len(found)} engine requests match completion {index} of request "
                               f"{request_id!r} (captured: {sorted(self._rows)[:8]})")
        return self.take(found[0], num_tokens)

    def clear(self) -> None:
        self._rows.clear()
