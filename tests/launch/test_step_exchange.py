"""The step exchange of several Ray rollout actors (``launch.ray.exchange.StepExchange``) on its own: a collective
answers once every share's part is there, in share order; a restarted actor that calls a finished collective again
gets what the others went on with; what is still waited for can be listed. (Its use by the shaping and dynamic
sampling is tests/launch/test_collectives.py.)"""

from __future__ import annotations

import asyncio

import pytest

from mmrlhf.launch.ray.exchange import KEPT_STEPS, SharesWorld, StepExchange


def test_a_collective_waits_for_every_share_and_answers_in_share_order():
    async def run():
        ex = StepExchange(3)
        first = asyncio.ensure_future(ex.gather(5, 0, 2, "c"))
        second = asyncio.ensure_future(ex.gather(5, 0, 0, "a"))
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()  # share 1 is missing
        assert ex.pending() == [(5, 0, [0, 2])]
        last = await ex.gather(5, 0, 1, "b")
        assert last == await first == await second == ["a", "b", "c"]
        assert ex.pending() == []

    asyncio.run(run())


def test_a_restarted_share_gets_the_parts_the_others_went_on_with():
    async def run():
        ex = StepExchange(2)
        await asyncio.gather(ex.gather(0, 0, 0, [1.0]), ex.gather(0, 0, 1, [2.0]))
        # share 1 died after this collective and regenerates the step (with other numbers, say): the others used
        # [1, 2] already, so it gets [1, 2]
        assert await ex.gather(0, 0, 1, [7.0]) == [[1.0], [2.0]]
        # and the step's next collective waits for it as usual
        nxt = asyncio.ensure_future(ex.gather(0, 1, 0, [3.0]))
        await asyncio.sleep(0.01)
        assert not nxt.done()
        assert await ex.gather(0, 1, 1, [4.0]) == [[3.0], [4.0]] == await nxt

    asyncio.run(run())


def test_finished_steps_are_forgotten_after_the_kept_window():
    async def run():
        ex = StepExchange(1)
        await ex.gather(0, 0, 0, "old")
        await ex.gather(KEPT_STEPS, 0, 0, "kept window")
        assert (0, 0) in ex._rounds  # a restarted actor may still ask for it
        await ex.gather(KEPT_STEPS + 1, 0, 0, "new")
        assert (0, 0) not in ex._rounds and (KEPT_STEPS, 0) in ex._rounds

    asyncio.run(run())


def test_bad_shares_and_mismatched_collectives_are_refused():
    with pytest.raises(ValueError, match="share 3 outside the 2 rollout actors"):
        asyncio.run(StepExchange(2).gather(0, 0, 3, None))
    with pytest.raises(ValueError, match="at least one share"):
        StepExchange(0)

    class Fixed:  # the other share called a collective of another length: a bug, said at once
        def gather(self, step, call, share, part):
            return [part, [1.0, 2.0]]

    world = SharesWorld(rank=0, world_size=2, launch="ray", exchange=Fixed(), step=3)
    with pytest.raises(RuntimeError, match=r"step 3: .* lengths \[1, 2\]"):
        world.all_sum([1.0])
    assert not world.sharded and world.all_max([1.0, 0.0]) == [1.0, 2.0]
