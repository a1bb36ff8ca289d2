"""The one loop that runs a rank's planned forwards: the experience maker's scoring, the policy and critic updates
and the Ray trainers' re-scoring all go through :func:`run_aligned`.

Why one loop: under FSDP every forward (and backward) gathers parameters in collectives, so every rank must run
exactly as many as the rank with the most micro-batches, or the ranks pair the wrong collectives and wait forever.
:func:`~mmrlhf.parallel.micro_batches.plan_micro_batches` agrees on that number and marks the slots a rank has no
samples for as empty lists; this loop turns each empty slot into a padding forward on real data whose result is
dropped. Written once, the three callers cannot disagree on what a padding slot does.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def run_aligned(micro_batches: Sequence[Sequence[int]], forward: Callable[[list[int], bool], T], *,
                pad: Sequence[int] | None = None) -> list[T]:
    """``forward(micro, padding)`` over one rank's micro-batches (item indices), in plan order; the results of the
    real micro-batches, in that order.

    An empty micro-batch is a padding slot: ``forward`` runs on ``pad`` (default: the first real micro-batch) with
    ``padding=True`` and its result is dropped (the caller zeroes its weight or skips what is not collective).
    ``pad`` must be given where a rank may hold no real micro-batch at all."""
    first = next((list(m) for m in micro_batches if m), None)
    spare = list(pad) if pad is not None else first
    out: list[T] = []
    for micro in micro_batches:
        if micro:
            out.append(forward(list(micro), False))
        elif spare:
            forward(list(spare), True)
        else:
            raise ValueError("a padding forward needs a micro-batch to repeat: this rank holds no sample and no "
                             "`pad` was given")
    return out
