"""``torchrun --nproc-per-node N -m mmrlhf train CONFIG``: data-parallel training with FSDP2.

Every rank builds the whole run (its own rollout engine, colocated with its shard of the policy), generates its
share of each step's prompts, scores and trains on its own samples; FSDP2 all-gathers the parameters for each
forward and reduce-scatters the gradients, and the update loop normalises the loss over all ranks, so a step equals
what one process would compute on the whole batch. Rank 0 alone writes metrics, reports and the progress bar; every
rank takes part in checkpoints (:mod:`mmrlhf.distributed.checkpoint`).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping


class SilentTracker:
    """The metrics tracker of ranks > 0: rank 0 writes the run's metrics (already averaged over ranks)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:  # noqa: ARG002
        return None

    def truncate_after(self, step: int) -> int:  # noqa: ARG002
        return 0

    def history(self) -> list[dict]:
        return []

    def close(self, *, failed: bool = False) -> None:  # noqa: ARG002
        return None

    def __enter__(self) -> "SilentTracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def run_torchrun(config: Any, *, resume: bool = False) -> int:
    """Join the process group, build this rank's trainer, train; the exit code of ``mmrlhf train``."""
    from mmrlhf.cli.train import train_and_report
    from mmrlhf.distributed.context import destroy, init_from_env

    try:
        dist = init_from_env(config.distributed.process_group)
    except (KeyError, ValueError, RuntimeError) as exc:
        print(f"error: torchrun process group: {exc}", file=sys.stderr)
        return 2
    try:
        return train_and_report(config, resume=resume, dist=dist)
    finally:
        destroy()
