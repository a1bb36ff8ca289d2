"""A served reward model merges the requests that arrive while it is busy into one batch."""

from __future__ import annotations

import asyncio

import pytest

from mmrlhf.rewards import RewardBatch, SourceScores
from mmrlhf.rewards.coalesce import CoalescingScorer, concat_batches


def request(values, images=False) -> RewardBatch:
    n = len(values)
    return RewardBatch(
        responses=[str(v) for v in values], prompts=["p"] * n, labels=["a"] * n, references=list(values),
        images=[[f"img{v}"] for v in values] if images else None,
    )


class Gated:
    """An async scorer whose FIRST call waits for ``release``; records the responses of every call."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()

    async def __call__(self, batch: RewardBatch) -> SourceScores:
        self.calls.append(list(batch.responses))
        if len(self.calls) == 1:
            await self.release.wait()
        if "bad" in batch.responses:
            raise ValueError("cannot process 'bad'")
        return SourceScores(scores=[float(r) * 10 for r in batch.responses], parts={"x": [1.0] * len(batch)},
                            notes={"text": [f"said {r}" for r in batch.responses]})


def test_requests_arriving_while_the_model_is_busy_are_scored_together_and_split_back():
    async def run():
        inner = Gated()
        scorer = CoalescingScorer(inner, max_samples=100)
        first = asyncio.ensure_future(scorer(request([1])))
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(scorer(request([10 * k + j for j in range(k)]))) for k in range(2, 6)]
        await asyncio.sleep(0)
        inner.release.set()
        return inner, scorer, await first, await asyncio.gather(*later)

    inner, scorer, first, later = asyncio.run(run())
    assert first.scores == [10.0]
    for k, res in zip(range(2, 6), later):
        assert res.scores == [float(10 * k + j) * 10 for j in range(k)] and res.parts["x"] == [1.0] * k
        assert res.notes["text"] == [f"said {10 * k + j}" for j in range(k)]  # a source's texts split back too
    assert len(inner.calls) == 2 and scorer.calls == 2  # the first alone, the four others in one call
    assert inner.calls[1] == [str(10 * k + j) for k in range(2, 6) for j in range(k)]


def test_a_merged_call_that_fails_is_retried_per_request_so_others_still_get_scores():
    async def run():
        inner = Gated()
        scorer = CoalescingScorer(inner, max_samples=100)
        first = asyncio.ensure_future(scorer(request([1])))
        await asyncio.sleep(0)
        good, bad = scorer(request([2, 3])), scorer(RewardBatch(["bad"], ["p"], ["a"], [None]))
        tasks = [asyncio.ensure_future(good), asyncio.ensure_future(bad)]
        await asyncio.sleep(0)
        inner.release.set()
        await first
        return await asyncio.gather(*tasks, return_exceptions=True)

    good, bad = asyncio.run(run())
    assert good.scores == [20.0, 30.0]
    assert isinstance(bad, ValueError) and "bad" in str(bad)


def test_merging_respects_the_sample_limit():
    async def run():
        inner = Gated()
        scorer = CoalescingScorer(inner, max_samples=4)
        first = asyncio.ensure_future(scorer(request([0])))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(scorer(request([k, k]))) for k in range(1, 6)]
        await asyncio.sleep(0)
        inner.release.set()
        await first
        await asyncio.gather(*rest)
        return inner

    inner = asyncio.run(run())
    assert [len(c) for c in inner.calls] == [1, 4, 4, 2]


def test_concat_keeps_images_aligned_and_refuses_different_columns():
    merged = concat_batches([request([1, 2], images=True), request([3])])
    assert merged.images == [["img1"], ["img2"], []] and merged.references == [1, 2, 3]
    other = RewardBatch(["1"], ["p"], ["a"], [None], extra={"difficulty": [1]})
    with pytest.raises(ValueError, match="not merged"):
        concat_batches([request([1]), other])
