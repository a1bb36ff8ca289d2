"""An engine's shutdown collects the heap once and leaves it frozen (vllm_setup.one_collection_at_shutdown)."""

from __future__ import annotations

import gc
import weakref

import pytest

from mmrlhf.rollout.vllm_setup import one_collection_at_shutdown


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_inside_no_collection_runs_after_one_does_and_the_survivors_are_frozen():
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.unfreeze()
    try:
        with one_collection_at_shutdown():
            garbage = _Cycle()
            gone = weakref.ref(garbage)
            del garbage
            assert gc.collect() == 0 and gone() is not None  # what vLLM's shutdown asks for waits
            gc.unfreeze()
        assert gone() is None  # collected once after
        assert gc.collect is collect and gc.unfreeze is unfreeze
        assert gc.get_freeze_count() > 0  # later collections walk only what is made afterwards
    finally:
        gc.unfreeze()


def test_an_error_inside_still_restores_the_collector():
    collect = gc.collect
    with pytest.raises(RuntimeError, match="shutdown failed"):
        with one_collection_at_shutdown():
            raise RuntimeError("shutdown failed")
    assert gc.collect is collect
    gc.unfreeze()
