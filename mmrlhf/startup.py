"""Garbage collection while a process of a run loads.

Loading the stack (torch, transformers, vLLM, the models: about a million objects that live as long as the process)
makes Python run full collections, each over the whole heap so far, and they find next to nothing: ten of them took
~3 s of the ~16 s a process spent importing on the 2-core CPU machine, and every launch (a ``mmrlhf train``, each
torchrun rank, each Ray actor) pays them. :func:`defer_full_collections` raises the third threshold while the process
loads (young objects are still collected as usual); :func:`loaded` puts it back once the trainer or the engine is
built, so that a run's steps collect as Python always does.
"""

from __future__ import annotations

import gc

# Full collections while loading: one per this many collections of the middle generation (Python's default is 10).
LOADING_THRESHOLD = 1000

_saved: tuple[int, int, int] | None = None


def defer_full_collections() -> None:
    """Raise the full-collection threshold until :func:`loaded` (a no-op when already raised)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(_saved[0], _saved[1], max(_saved[2], LOADING_THRESHOLD))


def loaded() -> None:
    """The process has loaded: the thresholds as they were before :func:`defer_full_collections`."""
    global _saved
    if _saved is not None:
        gc.set_threshold(*_saved)
        _saved = None
