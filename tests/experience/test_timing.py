"""``PhaseTimer``: phases add up, and a phase that ran inside another is moved out of it without changing the total
(the agent's tool calls inside its generation)."""

from __future__ import annotations

import pytest

from mmrlhf.experience.timing import PhaseTimer


def test_a_nested_phase_moves_out_of_its_parent_and_the_total_stays():
    timer = PhaseTimer()
    timer.seconds.update({"generate": 3.0, "tools": 0.5})  # a second round's tools already counted
    timer.move(1.25, source="generate", target="tools")
    assert timer.seconds == {"generate": 1.75, "tools": 1.75}
    assert timer.with_other(4.0) == {"generate": 1.75, "tools": 1.75, "other": 0.5}
    with pytest.raises(ValueError, match="out of phase 'generate'"):
        timer.move(2.0, source="generate", target="tools")  # more than the phase holds
    with pytest.raises(ValueError, match="out of phase 'prepare'"):
        timer.move(0.1, source="prepare", target="tools")
    assert timer.seconds == {"generate": 1.75, "tools": 1.75}  # a refused move changes nothing
