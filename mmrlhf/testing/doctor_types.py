"""What every ``mmrlhf doctor`` check shares: its options, its result row, and what the machine has (CUDA, vLLM).
A module of its own so that the checks can live in several modules (:mod:`mmrlhf.testing.doctor`,
:mod:`mmrlhf.testing.doctor_bench`) without importing one another."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmrlhf.testing.tiny_models import FAMILIES

STATUSES = ("pass", "fail", "skip")


@dataclass(frozen=True)
class DoctorOptions:
    device: str = "auto"  # trainer device: auto | cpu | cuda[:i]
    steps: int = 5  # toy-run length
    quick: bool = False  # smaller sizes everywhere (the CPU test)
    engine: str = "auto"  # toy runs' rollout engine: auto (vLLM when installed) | vllm | transformers
    families: tuple[str, ...] = FAMILIES  # engine_logprobs rows: every family of the tiny-model factory
    workdir: str = ""  # where runs write (a temporary folder when empty)


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip
    value: float | None = None  # the check's number (see ``unit``)
    unit: str = ""
    reason: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


# ---- what the machine has --------------------------------------------------------------------------------------
def cuda_device(device: str) -> bool:
    """Whether the checks run on a CUDA device."""
    import torch

    from mmrlhf.devices import resolve_device

    return resolve_device(device).type == "cuda" and torch.cuda.is_available()


def vllm_missing() -> str | None:
    """Why the vLLM engine cannot be used here (None: it can)."""
    try:
        from mmrlhf.rollout.vllm_setup import import_vllm

        import_vllm()
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        return f"vLLM unavailable: {str(exc).splitlines()[0]}"
    return None
