"""The ranks' sampling seeds: rank 0 keeps the run's seed (a one-process run samples as it did), every other rank
(torchrun ranks, Ray rollout actors under dynamic sampling) draws from a mixed seed, so that no rank of seed s samples
another rank's stream of seed s + 1; a run resumed from a checkpoint of the old ``seed + rank`` scheme keeps it
(tests/trainer/test_resume_damaged.py resumes a real one). Pure: no model loads."""

from __future__ import annotations

import threading

import pytest

from mmrlhf.config import build_config
from mmrlhf.parallel.world import World
from mmrlhf.trainer.builder import _rank_config


def _seed_of(seed: int, rank: int) -> int:
    """The sampling seed rank ``rank`` of a two-rank torchrun run seeded ``seed`` is built with."""
    config = build_config({"rollout": {"seed": seed}, "trainer": {"rollout_batch_size": 4, "train_batch_size": 4}})
    return _rank_config(config, World(rank=rank, world_size=2, launch="torchrun")).rollout.seed


def test_no_rank_of_one_seed_samples_another_ranks_stream_of_a_nearby_seed():
    for seed in (0, 1, 7, 41):
        assert _seed_of(seed, 0) == seed  # rank 0: the one-process seed, unchanged
        assert _seed_of(seed, 1) != _seed_of(seed + 1, 0)  # was seed + 1: rank 0's stream of the next seed
        assert _seed_of(seed, 1) not in range(0, 1 << 20)  # no small seed a user would pick


def test_rank_seeds_are_distinct_over_seeds_and_ranks_and_the_old_scheme_is_kept_on_request():
    from mmrlhf.rollout.builder import engine_seed
    from mmrlhf.rollout.types import rank_seed

    grid = {(s, r): rank_seed(s, r) for s in range(64) for r in range(8)}
    assert len(set(grid.values())) == len(grid)
    assert all(grid[(s, 0)] == s for s in range(64))
    assert all(0 <= v < 1 << 62 for v in grid.values())
    # control: the old scheme has the very coincidence the mixed one removes
    assert rank_seed(5, 1, "offset") == rank_seed(6, 0, "offset") == 6
    assert rank_seed(5, 0, "offset") == rank_seed(5, 0) == 5
    with pytest.raises(ValueError, match="unknown rank-seed scheme 'plus'"):
        rank_seed(5, 1, "plus")
    # vLLM seeds NumPy with its engine seed (32 bits): a rank's 62-bit seed is reduced there, and only there
    assert all(0 <= engine_seed(v) < 1 << 32 for v in grid.values()) and engine_seed(5) == 5


class _Maker:
    """What :meth:`ExperienceMakerHolder.load_position` touches of the experience maker."""

    def __init__(self, sampling):
        self.sampling, self.state = sampling, {}

    def load_state_dict(self, state):
        self.state = dict(state)

    def state_dict(self):
        return dict(self.state)


@pytest.mark.parametrize("index", [0, 1, 3])
def test_a_ray_rollout_actor_samples_with_its_seed_under_the_scheme_its_position_names(index):
    """Dynamic sampling in the Ray mode: each rollout actor's seed is its rank seed; a resume that loads the position
    of a run under the old scheme (``RayRollouts`` reads it from the checkpoint) puts the actor back on seed + index."""
    from mmrlhf.data.stream import PromptStream
    from mmrlhf.launch.ray.holder import ExperienceMakerHolder
    from mmrlhf.rollout.types import SamplingSettings, rank_seed

    holder = ExperienceMakerHolder.__new__(ExperienceMakerHolder)  # the actor's state, without its engine and models
    holder.index, holder._run_seed, holder._lock, holder._positions = index, 11, threading.Lock(), {}
    holder.stream = PromptStream(list(range(8)), seed=0, shuffle=False)
    holder.maker = _Maker(SamplingSettings(seed=rank_seed(11, index)))
    holder.load_position(3, {"epoch": 0, "position": 4, "seed": 0}, {"calls": 6}, "offset")
    assert holder.maker.sampling.seed == 11 + index and holder.maker.state == {"calls": 6}
    assert holder.stream.position == 4 and holder._next_step == 3
    holder.load_position(3, {"epoch": 0, "position": 4, "seed": 0}, {"calls": 6})  # a run of the mixed seeds
    assert holder.maker.sampling.seed == rank_seed(11, index)
    assert (holder.maker.sampling.seed == 11) == (index == 0)
