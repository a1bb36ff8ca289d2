"""Engine groups of torchrun ranks: ``rollout.tensor_parallel_size`` consecutive ranks share one vLLM engine.

vLLM's external launcher makes one tensor-parallel engine of each group of ``size`` consecutive ranks (its
``initialize_model_parallel`` splits the process group the ranks joined that way), every rank holding its shard of
the weights and running its own copy of the scheduler. Every rank of a group must therefore submit the SAME
requests with the same seeds, in the same calls. Who generates and who trains what:

- the group generates its share of the step's prompts: record ``i`` of the global batch (which every rank draws
  alike) belongs to group ``(i % world) // size`` (:meth:`EngineGroups.group_indices`), in the batch's order;
- rank ``i % world`` trains record ``i`` (:meth:`EngineGroups.trainer_of`): exactly the ``rank::world`` share a rank
  with an engine of its own trains, so every record trains once and each rank's part is what it would be at
  ``tensor_parallel_size`` 1. The loss normalisation, the skip cover, dynamic sampling's choice and the step-wide
  statistics then count each sample once, as they do there;
- the group samples with the group's seed (``rank_seed(rollout.seed, group)``): group 0 keeps the run's seed, and
  a world of one group generates what one process generates (the same prompts in the same order, the same seed).

With ``size`` 1 every rank is its own group and all of this is the plain ``rank::world`` dealing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineGroups:
    world_size: int
    size: int = 1  # ranks per engine (rollout.tensor_parallel_size)

    def __post_init__(self) -> None:
        if self.size < 1 or self.world_size % self.size:
            raise ValueError(f"rollout.tensor_parallel_size={self.size} with {self.world_size} training ranks: each "
                             f"engine spans {self.size} consecutive ranks, so the number of ranks must be a multiple "
                             "of it")

    @property
    def num_groups(self) -> int:
        return self.world_size // self.size

    def group_of(self, rank: int) -> int:
        """The engine group of ``rank`` (its seed index)."""
        return rank // self.size

    def ranks_of(self, group: int) -> range:
        return range(group * self.size, (group + 1) * self.size)

    def trainer_of(self, index: int) -> int:
        """The rank that trains record ``index`` of the step's global batch."""
        return index % self.world_size

    def group_indices(self, n: int, group: int) -> list[int]:
        """The records of a global batch of ``n`` that ``group`` generates, in the batch's order."""
        return [i for i in range(n) if self.trainer_of(i) // self.size == group]


def group_seed_index(rank: int, world_size: int, tensor_parallel_size: int) -> int:
    """The index whose rank seed a training rank samples with: its engine group's (its rank at size 1)."""
    return EngineGroups(world_size, tensor_parallel_size).group_of(rank)
