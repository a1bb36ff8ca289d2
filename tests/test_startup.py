"""A process of a run defers Python's full collections while it loads and restores them once built
(mmrlhf.startup)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from mmrlhf import startup


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield before
    startup.loaded()
    gc.set_threshold(*before)


def test_full_collections_wait_until_loaded_and_then_run_as_before(thresholds):
    gc.set_threshold(700, 10, 10)
    startup.defer_full_collections()
    assert gc.get_threshold() == (700, 10, startup.LOADING_THRESHOLD)
    startup.defer_full_collections()  # a second call (a process that defers twice) keeps what to restore
    startup.loaded()
    assert gc.get_threshold() == (700, 10, 10)
    startup.loaded()  # nothing deferred: nothing changes
    assert gc.get_threshold() == (700, 10, 10)


def test_a_higher_threshold_of_the_users_is_kept(thresholds):
    gc.set_threshold(500, 20, 5000)
    startup.defer_full_collections()
    assert gc.get_threshold() == (500, 20, 5000)
    startup.loaded()
    assert gc.get_threshold() == (500, 20, 5000)


def test_importing_torch_runs_no_full_collection_while_deferred():
    """The control: the same import with Python's thresholds runs full collections (3 on the 2-core machine)."""
    script = "import gc; {}import torch; print(gc.get_stats()[2]['collections'])"
    deferred = "from mmrlhf.startup import defer_full_collections; defer_full_collections(); "
    counts = [int(subprocess.run([sys.executable, "-c", script.format(prefix)], capture_output=True, text=True,
                                 check=True).stdout.split()[-1]) for prefix in ("", deferred)]
    assert counts[0] >= 1 and counts[1] == 0, counts
