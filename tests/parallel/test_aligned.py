"""The one rank-aligned forward loop (``mmrlhf.parallel.aligned.run_aligned``) that the maker's scoring, the updates
and the Ray re-scoring share: padding slots run on real data and are dropped, real ones keep their order."""

from __future__ import annotations

import pytest

from mmrlhf.parallel.aligned import run_aligned


def _recorder():
    calls = []

    def forward(micro, padding):
        calls.append((tuple(micro), padding))
        return sum(micro)

    return calls, forward


def test_padding_slots_repeat_the_first_real_micro_batch_and_are_dropped():
    calls, forward = _recorder()
    out = run_aligned([[3, 4], [], [1], []], forward)
    assert out == [7, 1]  # the real ones, in plan order
    assert calls == [((3, 4), False), ((3, 4), True), ((1,), False), ((3, 4), True)]  # as many forwards as slots


def test_a_given_pad_is_what_a_padding_slot_runs():
    calls, forward = _recorder()
    assert run_aligned([[], [5]], forward, pad=[0]) == [5]
    assert calls == [((0,), True), ((5,), False)]


def test_a_rank_with_only_padding_needs_a_pad():
    calls, forward = _recorder()
    assert run_aligned([[], []], forward, pad=[2]) == []
    assert calls == [((2,), True), ((2,), True)]  # it still pairs every collective of the other ranks
    with pytest.raises(ValueError, match="no sample"):
        run_aligned([[], []], forward)

