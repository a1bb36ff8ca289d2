"""Merge a served reward model's concurrent requests into one batch.

A model scores a batch of 32 in about the time it scores a batch of 4, so a server answering 8 concurrent clients
one request at a time wastes most of its device. ``CoalescingScorer`` runs at most one model call at a time; the
requests that arrive while it runs wait and are then scored together in the next call (no added delay for a lone
request, no timer). Results are split back per request, in order. If a merged call fails (one request's image
does not process, say), each of its requests is scored alone, so one client's bad data never fails another's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from mmrlhf.rewards.types import RewardBatch, SourceScores

logger = logging.getLogger(__name__)

Scorer = Callable[[RewardBatch], Awaitable[SourceScores]]


def concat_batches(batches: list[RewardBatch]) -> RewardBatch:
    """One batch of the text, images and extra columns of ``batches`` (each keeps its own sample indices).

    Raises ``ValueError`` when they cannot be merged (different extra columns, or token tensors present).
    """
    keys = set(batches[0].extra)
    if any(set(b.extra) != keys for b in batches) or any(b.sequences is not None or b.vision for b in batches):
        raise ValueError("batches with different extra columns or with token tensors are not merged")
    with_images = any(b.images is not None for b in batches)
    return RewardBatch(
        responses=[r for b in batches for r in b.responses],
        prompts=[p for b in batches for p in b.prompts],
        labels=[lab for b in batches for lab in b.labels],
        references=[ref for b in batches for ref in b.references],
        extra={k: [v for b in batches for v in b.extra[k]] for k in keys},
        images=[imgs for b in batches for imgs in (b.images or [[]] * len(b))] if with_images else None,
        index=[i for b in batches for i in (b.index or [])],
    )


class CoalescingScorer:
    """An async scorer that merges the requests arriving while a call runs (at most ``max_samples`` per call)."""

    def __init__(self, scorer: Scorer, *, max_samples: int) -> None:
        self.scorer = scorer
        self.max_samples = max_samples
        self._waiting: list[tuple[RewardBatch, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.calls = 0
        """Calls made to the wrapped scorer (for metrics and tests)."""

    async def __call__(self, batch: RewardBatch) -> SourceScores:
        if len(batch) == 0:
            return SourceScores.empty(0)
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((batch, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            group: list[tuple[RewardBatch, asyncio.Future]] = []
            size = 0
            while self._waiting and (not group or size + len(self._waiting[0][0]) <= self.max_samples):
                batch, future = self._waiting.pop(0)
                if not future.done():  # a request that timed out meanwhile is not scored
                    group.append((batch, future))
                    size += len(batch)
            if group:
                await self._score_group(group)

    async def _score_group(self, group: list[tuple[RewardBatch, asyncio.Future]]) -> None:
        try:
            merged = concat_batches([batch for batch, _ in group]) if len(group) > 1 else group[0][0]
            self.calls += 1
            out = await self.scorer(merged)
            if len(out.scores) != len(merged):
                raise RuntimeError(f"scorer returned {len(out.scores)} scores for {len(merged)} samples")
        except Exception as exc:  # noqa: BLE001 - set on the request(s), or retried one by one
            if len(group) == 1:
                _settle(group[0][1], exc=exc)
                return
            logger.warning("a merged batch of %d requests failed (%s); scoring them one by one", len(group), exc)
            for batch, future in group:
                await self._score_group([(batch, future)])
            return
        start = 0
        for batch, future in group:
            _settle(future, result=_slice(out, start, start + len(batch)))
            start += len(batch)


def _slice(out: SourceScores, start: int, stop: int) -> SourceScores:
    return SourceScores(
        scores=out.scores[start:stop],
        parts={name: values[start:stop] for name, values in out.parts.items()},
        errors=out.errors[start:stop],
        notes={name: texts[start:stop] for name, texts in out.notes.items()},
    )


def _settle(future: asyncio.Future, *, result: SourceScores | None = None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
