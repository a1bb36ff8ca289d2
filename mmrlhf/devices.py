"""Device selection from config strings (one rule for every model the framework places)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the accelerator torch reports as available (whatever its type), else CPU; others as given."""
    if name != "auto":
        return torch.device(name)
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return accelerator
    return torch.device("cpu")
