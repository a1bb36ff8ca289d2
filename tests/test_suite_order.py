"""The order the suite hands its files to its workers (mmrlhf.testing.suite_order): the longest measured files
first, the rest after in collection order, each file's tests in their own order; and the measured seconds read from
a pytest durations table; each worker's share of the cores for OpenMP."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mmrlhf.testing.suite_order import file_seconds, longest_files_first, worker_threads


@dataclass
class _Item:
    nodeid: str


def test_the_longest_files_go_first_and_each_keeps_its_tests_order():
    ids = ["a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "d.py::t1", "c.py::t2", "e.py::t1"]
    got = [i.nodeid for i in longest_files_first([_Item(n) for n in ids], {"c.py": 300.0, "b.py": 20.0})]
    assert got == ["c.py::t1", "c.py::t2", "b.py::t1", "a.py::t1", "a.py::t2", "d.py::t1", "e.py::t1"]
    # xdist's own order (most tests first) would have put c.py with a.py; no table: collection order by file
    assert [i.nodeid for i in longest_files_first([_Item(n) for n in ids], {})] == [
        "a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "d.py::t1", "e.py::t1"]


def test_seconds_per_file_from_a_durations_table():
    log = """============================= slowest 25 durations =============================
421.33s setup    tests/launch/test_ray_training.py::test_sync_run_learns_with_verified_weight_sync
352.71s call     tests/launch/test_ray_training.py::test_two[x-y]
0.50s teardown   tests/launch/test_ray_training.py::test_two[x-y]
96.85s call     tests/launch/test_torchrun.py::test_a_damaged_rank_shard
(3 durations < 0.005s hidden.  Use -vv to show these durations.)
FAILED tests/launch/test_one_loop.py::test_x - AssertionError: 1.5s
"""
    assert file_seconds(log) == {"tests/launch/test_ray_training.py": 421.33 + 352.71 + 0.5,
                                 "tests/launch/test_torchrun.py": 96.85}


def test_each_worker_runs_openmp_on_its_share_of_the_cores():
    assert [worker_threads(2, 2), worker_threads(16, 2), worker_threads(2, 4), worker_threads(3, 0)] == [1, 8, 1, 3]
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None and os.environ.get("OMP_NUM_THREADS") == str(
            worker_threads(len(os.sched_getaffinity(0)), int(workers))):  # tests/conftest.py set it (not the user)
        import torch

        assert torch.get_num_threads() == worker_threads(len(os.sched_getaffinity(0)), int(workers))
