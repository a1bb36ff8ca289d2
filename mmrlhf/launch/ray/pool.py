"""The rollout actors of a Ray run: started in their placement-group bundles, restarted in the same bundle when one
dies (``distributed.on_rollout_failure=restart``). Made by the driver, handed to trainer rank 0, which drives them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mmrlhf.launch.ray.holder import ExperienceMakerHolder, holder_name
from mmrlhf.launch.ray.runtime import PlacementPlan
from mmrlhf.parallel.ray_actors import actor_options, actor_threads


@dataclass
class HolderPool:
    config: dict[str, Any]  # the run's config (model_dump)
    plan: PlacementPlan
    placement_group: Any
    exchange: Any = None  # several rollout actors: the step exchange they all meet in (mmrlhf.launch.ray.exchange)
    handles: list[Any] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.plan.rollout)

    def start_all(self) -> None:
        """Start every rollout actor without waiting for it: the trainer actors build their models (and refuse a
        run, such as an output folder in use, in seconds) while the engines load; :meth:`ready` waits."""
        self.handles = [self.start(i) for i in range(self.count)]

    def ready(self) -> None:
        """Wait until every rollout actor is built (its engine loaded); raises the error of one that failed."""
        import ray

        ray.get([h.state.remote() for h in self.handles])

    def start(self, index: int) -> Any:
        """Rollout actor ``index`` in its bundle (a restarted one takes the same bundle)."""
        import ray

        slot = self.plan.rollout[index]
        options = actor_options(holder_name(index), slot.cpus, slot.gpus, placement_group=self.placement_group,
                                bundle_index=slot.bundle_index)
        # Weight chunks arrive while a batch is generated (see holder.py). Up to max_staleness + 1 requested batches
        # may wait on the generation lock: each holds a thread, and the chunks must still find a free one.
        options["max_concurrency"] = 2 + int(self.config["distributed"]["max_staleness"])
        cpus = self.config["distributed"]["rollout_actor_cpus"]
        remote = ray.remote(ExperienceMakerHolder)
        for attempt in range(20):
            try:
                return remote.options(**options).remote(self.config, index, self.count, actor_threads(cpus),
                                                        self.exchange)
            except ValueError as exc:  # the dead actor's name is released asynchronously
                if "already taken" not in str(exc) or attempt == 19:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def restart(self, index: int) -> Any:
        import ray

        ray.kill(self.handles[index], no_restart=True)
        self.handles[index] = self.start(index)
        ray.get(self.handles[index].state.remote())
        return self.handles[index]
