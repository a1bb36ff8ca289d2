"""Where the Ray launch mode's actors go: one placement-group bundle per rollout and trainer actor. What every actor's
process needs (environment, threads, options) is :mod:`mmrlhf.parallel.ray_actors`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmrlhf.parallel.ray_actors import resolve_actor_gpus


@dataclass(frozen=True)
class ActorSlot:
    """One actor's reservation: its bundle in the run's placement group."""

    cpus: float
    gpus: float
    bundle_index: int

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}


@dataclass(frozen=True)
class PlacementPlan:
    """Where the run's actors go: one placement-group bundle per actor, the rollout actors' first."""

    rollout: tuple[ActorSlot, ...]
    trainer: tuple[ActorSlot, ...]

    def bundles(self) -> list[dict[str, float]]:
        return [slot.bundle() for slot in (*self.rollout, *self.trainer)]

    @property
    def gpus(self) -> float:
        return sum(slot.gpus for slot in (*self.rollout, *self.trainer))


def plan_placement(distributed: Any, tensor_parallel_size: int, cluster_gpus: float) -> PlacementPlan:
    """The actors' reservations for ``distributed`` (the ``distributed`` config section) on a cluster with
    ``cluster_gpus`` GPUs. On a GPU cluster each rollout actor owns ``rollout.tensor_parallel_size`` GPUs (its
    engine's workers) and each trainer actor one, unless set; refused by key when it cannot work (0 GPUs, a
    tensor-parallel engine without that many whole GPUs, more GPUs than the cluster has)."""
    d = distributed
    rollout_gpus = resolve_actor_gpus(d.rollout_actor_gpus, "distributed.rollout_actor_gpus",
                                      float(tensor_parallel_size), cluster_gpus)
    trainer_gpus = resolve_actor_gpus(d.trainer_actor_gpus, "distributed.trainer_actor_gpus", 1.0, cluster_gpus)
    if cluster_gpus > 0 and tensor_parallel_size > 1 and rollout_gpus != tensor_parallel_size:
        raise ValueError(f"distributed.rollout_actor_gpus={rollout_gpus:g} with rollout.tensor_parallel_size="
                         f"{tensor_parallel_size}: a tensor-parallel engine needs one whole GPU per worker; set "
                         f"distributed.rollout_actor_gpus={tensor_parallel_size} (or leave it unset)")
    rollout = tuple(ActorSlot(d.rollout_actor_cpus, rollout_gpus, i) for i in range(d.num_rollout_actors))
    trainer = tuple(ActorSlot(d.trainer_actor_cpus, trainer_gpus, len(rollout) + i)
                    for i in range(d.num_trainer_actors))
    plan = PlacementPlan(rollout, trainer)
    if plan.gpus > cluster_gpus > 0:
        raise ValueError(
            f"the actors need {plan.gpus:g} GPUs (distributed.num_rollout_actors={d.num_rollout_actors} x "
            f"distributed.rollout_actor_gpus={rollout_gpus:g} + distributed.num_trainer_actors="
            f"{d.num_trainer_actors} x distributed.trainer_actor_gpus={trainer_gpus:g}) but the cluster has "
            f"{cluster_gpus:g}: lower those keys (or rollout.tensor_parallel_size)")
    return plan
