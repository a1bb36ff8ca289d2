"""Checkpoints of a torchrun run: the same folder layout as one process (``model/`` in Hugging Face format,
``trainer_state.json``), with the optimiser states (and the critic) saved SHARDED by ``torch.distributed.checkpoint``
(``optimizer/``): each rank writes its own shards, nothing is gathered, and a resume (with the same number of ranks or
another, DCP re-shards on load) reads them back.

The policy is gathered for ``model/`` because that is what users load (transformers, vLLM, ``model.pretrain`` of the
next run): one tensor at a time, kept only by rank 0.

A save is collective: rank 0 owns the folder (the private ``.tmp-`` folder of :class:`CheckpointManager`, renamed
into place once complete), tells the other ranks where it is, and renames it only after every rank has written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from mmrlhf.distributed.context import DistContext, full


def save_collective(dist: DistContext, manager: Any, step: int, write: Callable[[Path], None]) -> Path:
    """``manager.save(step, write)`` run by every rank: ``write(folder)`` is called on every rank with the same
    (temporary) folder; the checkpoint becomes visible once all have returned. Returns the final path."""
    if dist.is_main:
        def write_all(tmp: Path) -> None:
            dist.broadcast_object(str(tmp))
            write(tmp)
            dist.barrier()

        path = manager.save(step, write_all)
        dist.broadcast_object(str(path))
        return path
    tmp = Path(dist.broadcast_object(None))
    write(tmp)
    dist.barrier()
    return Path(dist.broadcast_object(None))


def _counters(stepper: Any) -> dict[str, Any]:
    """A GuardedStepper's state without the optimiser (which DCP saves sharded)."""
    return {"scheduler": None if stepper.scheduler is None else stepper.scheduler.state_dict(),
            "skipped_total": stepper.skipped_total, "skipped_in_a_row": stepper.skipped_in_a_row,
            "steps": stepper.steps}


def _set_counters(stepper: Any, state: dict[str, Any]) -> None:
    if stepper.scheduler is not None and state.get("scheduler") is not None:
        stepper.scheduler.load_state_dict(state["scheduler"])
    stepper.skipped_total = int(state["skipped_total"])
    stepper.skipped_in_a_row = int(state["skipped_in_a_row"])
    stepper.steps = int(state["steps"])


def _dcp_state(trainer: Any) -> dict[str, Any]:
    """What DCP saves and loads in place: optimiser states (and the critic's weights), as sharded state dicts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    p = trainer.p
    state = {"policy_optim": get_optimizer_state_dict(p.policy.actor, p.policy.stepper.optimizer)}
    if p.critic is not None:
        state["critic"] = get_model_state_dict(p.critic.critic)
        state["critic_optim"] = get_optimizer_state_dict(p.critic.critic, p.critic.stepper.optimizer)
    return state


def write_sharded(trainer: Any, folder: Path) -> None:
    """Every rank: the gathered policy (rank 0 writes ``model/``), the sharded optimiser and critic states
    (``optimizer/``), this rank's RNG state; rank 0 also writes ``trainer_state.json`` and the steppers' counters."""
    import torch.distributed.checkpoint as dcp

    from mmrlhf.trainer.state import rng_state_json, rng_state_tensors

    p, dist = trainer.p, trainer.p.dist
    model = p.policy.actor.model
    gathered = {}
    for name, tensor in model.state_dict().items():  # one collective per sharded tensor, in the same order
        value = full(tensor.detach())
        if dist.is_main:
            gathered[name] = value.cpu().clone()
    if dist.is_main:
        model.save_pretrained(folder / "model", state_dict=gathered, safe_serialization=True)
        p.processor.save_pretrained(folder / "model")
    del gathered
    dcp.save(_dcp_state(trainer), checkpoint_id=str(folder / "optimizer"))
    torch.save(rng_state_tensors({"shuffle": p.shuffle}), folder / f"rng-rank{dist.rank}.pt")
    (folder / f"rng-rank{dist.rank}.json").write_text(json.dumps(rng_state_json()))
    if dist.is_main:
        steppers = {"policy": _counters(p.policy.stepper)}
        if p.critic is not None:
            steppers["critic"] = _counters(p.critic.stepper)
        torch.save(steppers, folder / "steppers.pt")
        state = {"trainer": trainer.state.to_json(), "stream": p.stream.state_dict(), "maker": p.maker.state_dict(),
                 "config": trainer.s.config, "world_size": dist.world_size}
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=1, default=float))


def load_sharded(trainer: Any, folder: Path) -> None:
    """Every rank: restore what :func:`write_sharded` wrote (the policy weights come from ``model/`` through the
    builder, as in one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from mmrlhf.trainer.state import TrainerState, restore_rng

    p, dist = trainer.p, trainer.p.dist
    state = json.loads((folder / "trainer_state.json").read_text())
    if "world_size" not in state:
        raise ValueError(f"{folder} was written by a one-process run; resume it without torchrun (its optimiser "
                         "state is not sharded)")
    trainer.state = TrainerState.from_json(state["trainer"])
    p.stream.load_state_dict(state["stream"])
    p.maker.load_state_dict(state["maker"])
    sharded = _dcp_state(trainer)
    dcp.load(sharded, checkpoint_id=str(folder / "optimizer"))
    set_optimizer_state_dict(p.policy.actor, p.policy.stepper.optimizer, optim_state_dict=sharded["policy_optim"])
    steppers = torch.load(folder / "steppers.pt", weights_only=True)
    _set_counters(p.policy.stepper, steppers["policy"])
    if p.critic is not None:
        set_model_state_dict(p.critic.critic, sharded["critic"])
        set_optimizer_state_dict(p.critic.critic, p.critic.stepper.optimizer, optim_state_dict=sharded["critic_optim"])
        _set_counters(p.critic.stepper, steppers["critic"])
    rank_file = folder / f"rng-rank{dist.rank}.pt"
    if rank_file.exists():  # same number of ranks: each continues its own random streams
        restore_rng(json.loads((folder / f"rng-rank{dist.rank}.json").read_text()),
                    torch.load(rank_file, weights_only=True), {"shuffle": p.shuffle})
    p.tracker.truncate_after(trainer.state.step)
