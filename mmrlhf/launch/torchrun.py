"""``torchrun --nproc-per-node N -m mmrlhf train CONFIG``: N ranks of the one loop, FSDP2 over them.

Every rank builds its rollout engine (colocated with its shard of the policy; with ``rollout.tensor_parallel_size``
> 1 each group of that many consecutive ranks shares one tensor-parallel engine and generates the group's prompts,
:mod:`mmrlhf.parallel.engine_groups`), scores and trains on its own share of each step's samples; FSDP2 all-gathers the parameters for each forward and
reduce-scatters the gradients, and the update loop normalises the loss over all ranks, so a step equals what one
process would compute on the whole batch. Rank 0 alone writes metrics, reports and the progress bar; every rank
takes part in checkpoints (:mod:`mmrlhf.trainer.run_checkpoint`).
"""

from __future__ import annotations

import sys
from typing import Any


def check_torchrun_config(config: Any, world_size: int) -> None:
    """What torchrun ranks and their colocated engines cannot do: refused by key."""
    from mmrlhf.rollout.vllm_setup import check_torchrun_tensor_parallel

    tp = config.rollout.tensor_parallel_size
    check_torchrun_tensor_parallel(tp, world_size)
    if tp > 1 and config.agent.loop == "async":
        raise ValueError(f"agent.loop=async with rollout.tensor_parallel_size={tp} under torchrun: the ranks of an "
                         "engine group must make the same engine calls, which the asynchronous loop's timing does not "
                         "promise; use agent.loop=lockstep (or auto, which picks it there)")
    if world_size > 1 and config.rollout.engine == "transformers":
        raise ValueError("rollout.engine=transformers under torchrun: that engine generates with the (now sharded) "
                         "policy itself, and ranks stopping at different lengths would wait on each other forever; "
                         "use rollout.engine=vllm")


def run_torchrun(config: Any, *, resume: bool = False) -> int:
    """Join the process group, train this rank; the exit code of ``mmrlhf train``."""
    from mmrlhf.launch.report import train_and_report
    from mmrlhf.parallel.world import join_from_env, leave

    try:
        world = join_from_env(config.distributed.process_group,
                              host_tensors=config.distributed.offload != "none")
        check_torchrun_config(config, world.world_size)
    except (KeyError, ValueError, RuntimeError) as exc:
        print(f"error: torchrun: {exc}", file=sys.stderr)
        leave()
        return 2
    try:
        return train_and_report(config, resume=resume, world=world)
    finally:
        leave()
