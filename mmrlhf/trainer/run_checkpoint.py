"""What a checkpoint holds, written and read by one pair of functions for every launch mode.

Layout (inside a :class:`~mmrlhf.trainer.checkpoint.CheckpointManager` folder):

- ``model/``: the policy in Hugging Face format (what users load: transformers, vLLM, ``model.pretrain`` of the
  next run); a sharded policy is gathered one tensor at a time and kept by rank 0 only; a LoRA policy is merged, its
  peft adapter in ``adapter/``.
- ``optimizer/``: the optimiser states (and the critic's weights) through ``torch.distributed.checkpoint`` (DCP).
  Each rank writes its own shards, nothing is gathered, and a load re-shards: a run resumes on another number of
  ranks or in another launch mode. DCP's ``.metadata`` is a pickle: resume only your own checkpoints.
- ``steppers.pt``: the schedulers and skip counters (plain values, read with ``weights_only=True``).
- ``rng-rank<r>.pt`` / ``.json``: each rank's random states (restored when the number of ranks is the same).
- ``trainer_state.json``: one schema (:data:`SCHEMA`) in every mode: the launch mode and ranks that wrote it, the
  trainer's counters, the rollout source's position (data order, sampling counters), the run's config and how its
  ranks' sampling seeds were derived (:data:`RANK_SEEDS`); and that the save records a manifest (so a lost
  ``manifest.json`` reads as damage, not as an older checkpoint).
- ``manifest.json``: every file's size and checksum, written by the save itself once all ranks' files exist
  (:mod:`mmrlhf.trainer.checkpoint_manifest`).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from mmrlhf.parallel.world import full
from mmrlhf.rollout.types import RANK_SEED_SCHEMES
from mmrlhf.trainer.checkpoint_manifest import MANIFEST, STATE_KEY
from mmrlhf.trainer.progress import no_library_bars
from mmrlhf.trainer.state import TrainerState, restore_rng, rng_state_json, rng_state_tensors

logger = logging.getLogger(__name__)

SCHEMA = 2  # trainer_state.json; 1 (unversioned) was written per launch mode before the loop was one
# How the run's ranks (and Ray rollout actors) derive their sampling seeds (mmrlhf.rollout.types.rank_seed), recorded
# in trainer_state.json as ``rank_seeds``; a checkpoint without it was written under ``offset`` (seed + rank).
RANK_SEEDS, LEGACY_RANK_SEEDS = RANK_SEED_SCHEMES


def rank_seeds_of(folder: Path) -> str:
    """The rank-seed scheme of the run that wrote checkpoint ``folder``: a resumed run keeps it, so that each rank's
    sampling goes on as it began (:data:`LEGACY_RANK_SEEDS` for a checkpoint that records none)."""
    state_file = Path(folder) / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    return str(state.get("rank_seeds", LEGACY_RANK_SEEDS))


def write_run_state(trainer: Any, folder: Path) -> None:
    """Every rank, into the same (temporary) folder: see the module docstring."""
    import torch.distributed.checkpoint as dcp

    p, world = trainer.p, trainer.p.world
    _write_policy(p.policy.actor.model, p.processor, folder, main=world.is_main)
    with _no_dist_warning():  # one rank: no collectives (whatever group vLLM may have made in this process)
        dcp.save(_dcp_state(p), checkpoint_id=str(folder / "optimizer"), no_dist=not world.sharded)
    torch.save(rng_state_tensors({"shuffle": p.shuffle}), folder / f"rng-rank{world.rank}.pt")
    (folder / f"rng-rank{world.rank}.json").write_text(json.dumps(rng_state_json()))
    rollouts = p.source.save(folder, trainer.state.step)  # every rank; rank 0's is saved
    if not world.is_main:
        return
    steppers = {"policy": _counters(p.policy.stepper)}
    if p.critic is not None:
        steppers["critic"] = _counters(p.critic.stepper)
    torch.save(steppers, folder / "steppers.pt")
    state = {"schema": SCHEMA, "launch": world.launch, "world_size": world.world_size,
             "trainer": trainer.state.to_json(), "rollouts": rollouts, "config": trainer.s.config,
             "rank_seeds": trainer.s.rank_seeds, STATE_KEY: MANIFEST}
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=1, default=float))


def load_run_state(trainer: Any, folder: Path) -> None:
    """Every rank: restore what :func:`write_run_state` wrote (the policy weights come from ``model/`` through the
    builder). A checkpoint of the one-process format before :data:`SCHEMA` 2 (``optimizer.pt``) loads too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    p, world = trainer.p, trainer.p.world
    state = json.loads((folder / "trainer_state.json").read_text())
    trainer.state = TrainerState.from_json(state["trainer"])
    p.source.load(folder, state.get("rollouts") or {"stream": state["stream"], "maker": state["maker"]})
    if (folder / "optimizer.pt").exists():  # schema 1, one process
        _load_legacy_single(p, folder)
        return
    sharded = _dcp_state(p)
    with _no_dist_warning():
        dcp.load(sharded, checkpoint_id=str(folder / "optimizer"), no_dist=not world.sharded)
    set_optimizer_state_dict(p.policy.actor, p.policy.stepper.optimizer, optim_state_dict=sharded["policy_optim"])
    steppers = torch.load(folder / "steppers.pt", weights_only=True)
    _set_counters(p.policy.stepper, steppers["policy"])
    if p.critic is not None:
        set_model_state_dict(p.critic.critic, sharded["critic"])
        set_optimizer_state_dict(p.critic.critic, p.critic.stepper.optimizer, optim_state_dict=sharded["critic_optim"])
        _set_counters(p.critic.stepper, steppers["critic"])
    rank_file = folder / f"rng-rank{world.rank}.pt"
    if int(state.get("world_size", 1)) == world.world_size and rank_file.exists():
        restore_rng(json.loads((folder / f"rng-rank{world.rank}.json").read_text()),
                    torch.load(rank_file, weights_only=True), {"shuffle": p.shuffle})
    elif world.is_main:
        logger.warning("%s was written by %s ranks, this run has %d: each rank's random streams start afresh (data "
                       "order, optimiser and statistics continue)", folder, state.get("world_size"),
                       world.world_size)


def _write_policy(model: Any, processor: Any, folder: Path, *, main: bool) -> None:
    """``model/`` (and ``adapter/`` for LoRA), gathered tensor by tensor: every rank takes part in the gathers of a
    sharded policy (one collective per tensor, in the same order), rank 0 keeps and writes."""
    from mmrlhf.models.lora import lora_model, save_lora_checkpoint

    if lora_model(model) is not None:  # sharded adapters and bases are gathered by every rank, written by rank 0
        with no_library_bars():
            save_lora_checkpoint(model, folder, write=main)
        if main:
            processor.save_pretrained(folder / "model")
        return
    gathered = {}
    for name, tensor in model.state_dict().items():
        value = full(tensor.detach())
        if main:
            gathered[name] = value.cpu().clone()
    if main:
        with no_library_bars():
            model.save_pretrained(folder / "model", state_dict=gathered, safe_serialization=True)
        processor.save_pretrained(folder / "model")


def _dcp_state(p: Any) -> dict[str, Any]:
    """What DCP saves and loads in place: optimiser states (and the critic's weights), as (sharded) state dicts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"policy_optim": get_optimizer_state_dict(p.policy.actor, p.policy.stepper.optimizer)}
    if p.critic is not None:
        state["critic"] = get_model_state_dict(p.critic.critic)
        state["critic_optim"] = get_optimizer_state_dict(p.critic.critic, p.critic.stepper.optimizer)
    return state


def _counters(stepper: Any) -> dict[str, Any]:
    """A GuardedStepper's state without the optimiser (which DCP saves)."""
    return {"scheduler": None if stepper.scheduler is None else stepper.scheduler.state_dict(),
            "skipped_total": stepper.skipped_total, "skipped_in_a_row": stepper.skipped_in_a_row,
            "steps": stepper.steps}


def _set_counters(stepper: Any, state: dict[str, Any]) -> None:
    if stepper.scheduler is not None and state.get("scheduler") is not None:
        stepper.scheduler.load_state_dict(state["scheduler"])
    stepper.skipped_total = int(state["skipped_total"])
    stepper.skipped_in_a_row = int(state["skipped_in_a_row"])
    stepper.steps = int(state["steps"])


def _load_legacy_single(p: Any, folder: Path) -> None:
    """The optimiser, critic and RNG files of a schema-1 one-process checkpoint."""
    from safetensors.torch import load_file

    optim = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
    p.policy.stepper.load_state_dict(optim["policy"])
    if p.critic is not None:
        p.critic.critic.load_state_dict(load_file(str(folder / "critic.safetensors")))
        p.critic.stepper.load_state_dict(optim["critic"])
    state = json.loads((folder / "trainer_state.json").read_text())
    restore_rng(state["rng"], torch.load(folder / "rng.pt", weights_only=True), {"shuffle": p.shuffle})


class _no_dist_warning(warnings.catch_warnings):
    """DCP in a world of one rank (no process group) warns that it runs without one: that is the intent."""

    def __enter__(self) -> Any:
        out = super().__enter__()
        warnings.filterwarnings("ignore", message=".*process group.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return out
