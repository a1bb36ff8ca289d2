"""Weight perturbation for sync tests: a "trainer step" that moves every parameter measurably."""

from __future__ import annotations

import torch


def perturb_(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> None:
    """Add seeded noise (``scale`` times each tensor's spread) to every parameter, in place, then round to bf16
    so an engine serving bf16 weights can hold exactly the same values (compare like with like)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            spread = p.std() if p.numel() > 1 else torch.tensor(1.0)
            p.add_(torch.randn(p.shape, generator=gen) * scale * spread)
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
