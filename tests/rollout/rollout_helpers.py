"""Shared builders for the rollout tests."""

from __future__ import annotations

from mmrlhf.rollout.types import GenerationRequest
from mmrlhf.testing.engine_check import CheckCase, processor_inputs


def request_for(processor, adapter, case: CheckCase) -> GenerationRequest:
    """A request carrying both the text (for vLLM) and the processor's ids and tensors (for transformers)."""
    inputs = processor_inputs(processor, adapter, case)
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    return GenerationRequest(
        prompt=case.text, prompt_token_ids=inputs["input_ids"][0].tolist(), images=list(case.images),
        videos=list(case.videos), vision_inputs=vision, mm_token_type_ids=inputs["mm_token_type_ids"][0].tolist(),
    )
