"""What a resume must restore besides the models and optimisers: the step, the random number generators, and
the trainer's counters. RNG states travel as JSON (Python, NumPy) or as tensors (torch); nothing is pickled."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class TrainerState:
    """Counters of the run (everything JSON-serialisable)."""

    step: int = 0  # completed rollout steps
    samples_generated: int = 0
    samples_trained: int = 0
    empty_steps: int = 0  # steps where dynamic sampling kept no group (no update)
    last_eval: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainerState":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch (all devices) global generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state_json() -> dict[str, Any]:
    """Python and NumPy generator states as JSON values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def rng_state_tensors(extra: dict[str, torch.Generator] | None = None) -> dict[str, torch.Tensor]:
    """torch generator states (CPU, each CUDA device, and named private generators) as uint8 tensors."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    for name, gen in (extra or {}).items():
        out[f"gen_{name}"] = gen.get_state()
    return out


def restore_rng(json_state: dict[str, Any], tensors: dict[str, torch.Tensor],
                extra: dict[str, torch.Generator] | None = None) -> None:
    version, internal, gauss = json_state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json_state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        # A rank saves every device it sees; the resumed process may see fewer (a torchrun rank of an 8-GPU node
        # resumed by a Ray trainer actor, which sees its one GPU, or on nodes of 4): the devices it has get theirs.
        saved = sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
        states = [tensors[k] for k in saved][: torch.cuda.device_count()]
        if states:
            torch.cuda.set_rng_state_all(states)
    for name, gen in (extra or {}).items():
        gen.set_state(tensors[f"gen_{name}"])
