"""The launch layer: how ``mmrlhf train`` starts the one training loop (:class:`~mmrlhf.trainer.loop.Trainer`).

A launch mode decides where a step's experiences come from and how many ranks train, nothing else:

- ``single``: one process, an engine in it, a world of one rank (:mod:`mmrlhf.launch.report`);
- ``torchrun``: every process a rank with its own engine, FSDP2 over the ranks (:mod:`mmrlhf.launch.torchrun`);
- ``ray``: rollout actors generate, N trainer actors are the ranks (:mod:`mmrlhf.launch.ray`).

Nothing below this package imports it (tests/test_layers.py holds that).
"""

from __future__ import annotations

from typing import Any


def run(config: Any, *, resume: bool = False) -> int:
    """Train ``config`` in the launch mode ``distributed.backend`` names (``auto``: torchrun when started by it, else
    one process); the exit code of ``mmrlhf train`` (0 done or interrupted with a checkpoint, 1 stopped by a failure,
    2 misconfigured)."""
    import sys

    from mmrlhf.launch.backend import resolve_backend

    try:
        backend = resolve_backend(config.distributed.backend)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if backend == "ray":
        from mmrlhf.launch.ray.driver import run_ray

        return run_ray(config, resume=resume)
    if backend == "torchrun":
        from mmrlhf.launch.torchrun import run_torchrun

        return run_torchrun(config, resume=resume)
    from mmrlhf.launch.report import train_and_report

    if config.distributed.offload != "none":  # FSDP2's offload shards over a world of one rank: it needs a group
        from mmrlhf.parallel.world import join_alone, leave

        try:
            return train_and_report(config, resume=resume, world=join_alone(
                config.distributed.process_group, host_tensors=True))
        finally:
            leave()
    return train_and_report(config, resume=resume)
