"""Where the Ray launch mode's actors go: one placement-group bundle per rollout and trainer actor. What every actor's
process needs (environment, threads, options) is :mod:`mmrlhf.parallel.ray_actors`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from mmrlhf.parallel.ray_actors import resolve_actor_gpus


@dataclass(frozen=True)
class ActorSlot:
    """One actor's reservation: its bundle in the run's placement group."""

    cpus: float
    gpus: float
    bundle_index: int
    resources: tuple[tuple[str, float], ...] = field(default=())  # Ray custom resources (distributed.*_resources)

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **dict(self.resources)}


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

    def custom_resources(self) -> dict[str, float]:
        """The custom resources the actors reserve in all (name -> amount)."""
        total: dict[str, float] = {}
        for slot in (*self.rollout, *self.trainer):
            for name, amount in slot.resources:
                total[name] = total.get(name, 0.0) + amount
        return total


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
    rollout_resources = tuple(sorted(d.rollout_actor_resources.items()))
    trainer_resources = tuple(sorted(d.trainer_actor_resources.items()))
    rollout = tuple(ActorSlot(d.rollout_actor_cpus, rollout_gpus, i, rollout_resources)
                    for i in range(d.num_rollout_actors))
    trainer = tuple(ActorSlot(d.trainer_actor_cpus, trainer_gpus, len(rollout) + i, trainer_resources)
                    for i in range(d.num_trainer_actors))
    plan = PlacementPlan(rollout, trainer)
    if plan.gpus > cluster_gpus > 0:
        raise ValueError(
            f"the actors need {plan.gpus:g} GPUs (distributed.num_rollout_actors={d.num_rollout_actors} x "
            f"distributed.rollout_actor_gpus={rollout_gpus:g} + distributed.num_trainer_actors="
            f"{d.num_trainer_actors} x distributed.trainer_actor_gpus={trainer_gpus:g}) but the cluster has "
            f"{cluster_gpus:g}: lower those keys (or rollout.tensor_parallel_size)")
    return plan


def check_custom_resources(distributed: Any, plan: PlacementPlan, cluster: Mapping[str, float]) -> None:
    """Refuse, by key, custom resources (``distributed.rollout_actor_resources`` / ``trainer_actor_resources``) the
    cluster ``cluster`` (``ray.cluster_resources()``) does not hold in the amounts the actors ask for in all: the
    placement group would otherwise wait for nodes that never come."""
    d = distributed
    for name, need in plan.custom_resources().items():
        have = float(cluster.get(name, 0.0))
        if need <= have:
            continue
        asks = [f"distributed.{kind}_actor_resources.{name}={per:g} x {count}" for kind, per, count in (
            ("rollout", d.rollout_actor_resources.get(name, 0.0), d.num_rollout_actors),
            ("trainer", d.trainer_actor_resources.get(name, 0.0), d.num_trainer_actors)) if per]
        custom = {k: v for k, v in cluster.items() if k not in ("CPU", "GPU", "memory", "object_store_memory")
                  and not k.startswith("node:")}
        raise ValueError(f"the actors ask for {need:g} of the Ray resource {name!r} ({' + '.join(asks)}) but the "
                         f"cluster has {have:g} (its custom resources: {custom or 'none'}): start the nodes meant for "
                         f"these actors with ray start --resources '{{\"{name}\": N}}', or change those keys")
