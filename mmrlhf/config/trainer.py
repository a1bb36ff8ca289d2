"""``trainer``: optimisation and bookkeeping of the training loop."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmrlhf.config.base import Section


class TrainerConfig(Section):
    """Read by the trainer (roadmap item 1; not landed yet): until it lands these keys are validated, shown by
    ``config show`` and documented, but no command consumes them."""

    lr: float = Field(default=1e-6, gt=0.0)
    """Actor learning rate."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    """Gradient clipping norm."""
    rollout_batch_size: int = Field(default=32, ge=1)
    """Prompts per rollout step."""
    train_batch_size: int = Field(default=128, ge=1)
    """Samples per optimiser step."""
    micro_train_batch_size: int = Field(default=4, ge=1)
    """Samples per forward/backward pass (gradient accumulation fills ``train_batch_size``)."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each batch of experience."""
    max_steps: int = Field(default=1000, ge=1)
    """Rollout steps to run."""
    packing_samples: bool = False
    """Pack sequences without padding (works with images and video)."""
    seed: int = 42
    """Global seed (torch, numpy, python, data order)."""
    output_dir: str = "outputs/run"
    """Where logs and checkpoints go."""
    save_steps: int = Field(default=100, ge=1)
    """Checkpoint every this many steps."""
    log_steps: int = Field(default=1, ge=1)
    """Log metrics every this many steps."""
    device: str = "auto"
    """Training device: ``auto`` picks CUDA when available, else CPU; or an explicit torch device string."""
