"""Optimiser, learning-rate schedule and which parameters train.

The schedule counts OPTIMISER steps (a rollout step makes ``ppo_epochs * samples / train_batch_size`` of them):
linear warm-up from 0 over ``warmup_steps``, then constant, cosine or linear decay to ``min_lr_ratio * lr`` at the
last optimiser step of the run. A plain function of the step count, so its state is just that count.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimiser step ``step`` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def build_optimizer(params: Iterable[nn.Parameter], *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; 1-D parameters (norms, biases) get no weight decay."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: every parameter is frozen (check trainer.freeze_* settings)")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def build_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int, total_steps: int,
                    min_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps,
                         min_ratio=min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def freeze_vision(model: nn.Module, adapter: Any, *, tower: bool, merger: bool) -> dict[str, int]:
    """Set ``requires_grad`` on the vision tower (its mergers excluded) and on the mergers; returns counts of
    trainable and frozen parameters (elements). Why the tower is frozen by default: its features are what the
    language model learned to read, and RL rewards are too sparse to retrain them; the merger (the projection into
    the language model) stays trainable so the policy can still re-weight what it sees."""
    vision, mergers = adapter.vision_parts(model)
    merger_ids = {id(p) for m in mergers for p in m.parameters()}
    for p in vision.parameters():
        p.requires_grad_(not (merger if id(p) in merger_ids else tower))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {"trainable": trainable, "frozen": frozen}
