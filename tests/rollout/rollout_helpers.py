"""Shared builders for the rollout tests."""

from __future__ import annotations

import torch

from mmrlhf.rollout.types import GenerationRequest
from mmrlhf.testing.engine_check import CheckCase, actor_response_logprobs, processor_inputs


def request_for(processor, adapter, case: CheckCase, request_id: str | None = None) -> GenerationRequest:
    """A request carrying both the text (for vLLM) and the processor's ids and tensors (for transformers)."""
    inputs = processor_inputs(processor, adapter, case)
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    return GenerationRequest(
        prompt=case.text, prompt_token_ids=inputs["input_ids"][0].tolist(), images=list(case.images),
        videos=list(case.videos), vision_inputs=vision, mm_token_type_ids=inputs["mm_token_type_ids"][0].tolist(),
        request_id=request_id,
    )


def actor_diffs(result, requests, actor, *, temperature: float, stop_ids) -> tuple[list[float], float]:
    """Engine log-probs vs ActorVL's at ``temperature``: per request the largest |engine - actor| over its samples'
    tokens, and the smallest signed engine - actor difference of the whole result."""
    worst, lowest = [], float("inf")
    for out in result.outputs:
        responses = [c.token_ids for c in out.completions]
        ref = actor_response_logprobs(actor, requests[out.request_index], responses, temperature=temperature,
                                      stop_ids=stop_ids)
        d = [torch.tensor(c.logprobs) - r for c, r in zip(out.completions, ref)]
        worst.append(max(float(x.abs().max()) for x in d))
        lowest = min(lowest, *(float(x.min()) for x in d))
    return worst, lowest
