"""Shared builders for the rollout tests."""

from __future__ import annotations

import torch

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


def perturb_(model, scale: float = 0.05, seed: int = 0) -> None:
    """Add seeded noise (relative to each tensor's spread) to every parameter, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            spread = p.std() if p.numel() > 1 else torch.tensor(1.0)
            p.add_(torch.randn(p.shape, generator=gen) * scale * spread)
            p.copy_(p.to(torch.bfloat16).float())  # representable in the engine's bf16: compare like with like
