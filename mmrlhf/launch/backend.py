"""Which launch mode a run uses (``distributed.backend``), decided before anything is built."""

from __future__ import annotations

import os
from typing import Mapping


def launched_by_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """torchrun (and ``torch.distributed.run``) export ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` to every worker."""
    return "LOCAL_RANK" in environ and "WORLD_SIZE" in environ


def resolve_backend(backend: str, environ: Mapping[str, str] = os.environ) -> str:
    """``auto`` -> ``torchrun`` under torchrun with more than one process, else ``single``. An explicit choice is
    checked against how the process was started, so a wrong launch fails at once with the command to use."""
    under_torchrun = launched_by_torchrun(environ) and int(environ.get("WORLD_SIZE", "1")) > 1
    if backend == "auto":
        return "torchrun" if under_torchrun else "single"
    if backend == "torchrun" and not launched_by_torchrun(environ):
        raise ValueError("distributed.backend=torchrun but this process was not started by torchrun: run "
                         "`torchrun --nproc-per-node N -m mmrlhf train CONFIG ...`")
    if backend in ("single", "ray") and under_torchrun:
        raise ValueError(f"distributed.backend={backend} under torchrun (WORLD_SIZE={environ['WORLD_SIZE']}): "
                         "start it with plain `mmrlhf train`, or use distributed.backend=torchrun / auto")
    return backend
