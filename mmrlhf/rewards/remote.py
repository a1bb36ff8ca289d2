"""Client for remote reward servers: batching, a concurrency limit, timeouts, retries with backoff and jitter.

A batch is cut into requests of ``batch_size`` samples, at most ``max_concurrency`` in flight. Each request is
retried on connection errors, timeouts, 5xx and 429, waiting ``backoff_s * 2**attempt`` (capped at
``backoff_max_s``) with "equal jitter" (half fixed, half random) so that many clients recovering from one outage
do not hammer the server in lockstep. Other 4xx answers are not retried (resending a malformed request cannot help).

Alignment: each request's answer is checked to have exactly as many entries as it sent and is placed by its chunk
position, so a retried or reordered request can never shift scores onto other samples. If any request finally
fails, the whole call raises :class:`RemoteRewardError` naming the URL and the samples; nothing is half-returned.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mmrlhf.rewards.plugins import concat_scores, wait_all_or_first_error
from mmrlhf.rewards.types import RewardBatch, RewardError, RewardInputError, SourceScores
from mmrlhf.rewards.wire import ScoreResponse, encode_image

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class RemoteRewardError(RewardError):
    """A remote reward request failed for good (after retries, or with a non-retryable answer)."""


def read_token(path: str | Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); an empty file is an error."""
    path = Path(path).expanduser()
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise RewardError(f"cannot read token file {path}: {exc}") from None
    if not token:
        raise RewardError(f"token file {path} is empty")
    return token


class RemoteRewardClient:
    """Scores :class:`RewardBatch` es against ``url`` (a ``POST /score`` endpoint, see ``mmrlhf.rewards.wire``)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        batch_size: int = 32,
        max_concurrency: int = 8,
        send_images: bool = True,
        seed: int | None = None,
        transport: Any = None,
    ) -> None:
        """``seed`` fixes the jitter; ``transport`` replaces httpx's network transport (tests, custom stacks)."""
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("batch_size and max_concurrency must be >= 1, max_retries >= 0, timeout_s > 0")
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        self.send_images = send_images
        self._rng = random.Random(seed)
        self._transport = transport
        self.requests_sent = 0
        """Requests attempted so far, retries included (for metrics and tests)."""

    def backoff_delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based): half fixed, half random."""
        delay = min(self.backoff_max_s, self.backoff_s * (2**attempt))
        return delay / 2 + self._rng.uniform(0, delay / 2)

    async def score(self, batch: RewardBatch) -> SourceScores:
        """Scores for every sample of ``batch``, in order; raises :class:`RemoteRewardError` if any request fails."""
        import httpx

        if len(batch) == 0:
            return SourceScores.empty(0)
        starts = range(0, len(batch), self.batch_size)
        chunks = [batch.select(range(s, min(s + self.batch_size, len(batch)))) for s in starts]
        payloads = [self._payload(chunk) for chunk in chunks]
        semaphore = asyncio.Semaphore(self.max_concurrency)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(
            timeout=self.timeout_s, headers=headers, limits=limits, transport=self._transport
        ) as client:
            tasks = [
                asyncio.ensure_future(self._post(client, semaphore, body, chunk))
                for body, chunk in zip(payloads, chunks)
            ]
            await wait_all_or_first_error(tasks)
        return concat_scores([task.result() for task in tasks])

    def _payload(self, chunk: RewardBatch) -> bytes:
        extra = {}
        for name, column in chunk.extra.items():
            try:
                json.dumps(column)
            except (TypeError, ValueError) as exc:
                raise RewardInputError(f"extra column {name!r} cannot be sent to {self.url} as JSON: {exc}") from None
            extra[name] = column
        body: dict[str, Any] = {
            "responses": chunk.responses,
            "prompts": chunk.prompts,
            "labels": chunk.labels,
            "references": chunk.references,
            "extra": extra,
        }
        if self.send_images and chunk.images is not None:
            body["images"] = [[encode_image(img) for img in sample] for sample in chunk.images]
        return json.dumps(body).encode()

    async def _post(self, client, semaphore: asyncio.Semaphore, body: bytes, chunk: RewardBatch) -> SourceScores:
        import httpx

        where = f"{chunk.describe(0)} .. {chunk.describe(len(chunk) - 1)}"
        last_problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_delay(attempt - 1))
            async with semaphore:
                self.requests_sent += 1
                try:
                    response = await client.post(self.url, content=body, headers={"Content-Type": "application/json"})
                except httpx.TransportError as exc:  # connect / read errors and timeouts: retry
                    last_problem = f"{type(exc).__name__}: {exc or 'no detail'}"
                    continue
            if response.status_code == 200:
                return self._parse(response, chunk, where)
            detail = _detail(response)
            last_problem = f"HTTP {response.status_code}: {detail}"
            if response.status_code not in RETRY_STATUSES:
                raise RemoteRewardError(f"reward server {self.url} refused the request for {where}: {last_problem}")
        raise RemoteRewardError(
            f"reward server {self.url} failed for {where} after {self.max_retries + 1} attempts; last error: "
            f"{last_problem}"
        )

    def _parse(self, response, chunk: RewardBatch, where: str) -> SourceScores:
        try:
            answer = ScoreResponse.model_validate_json(response.content)
        except ValidationError as exc:
            raise RemoteRewardError(f"reward server {self.url} sent a malformed answer for {where}: {exc}") from None
        n = len(chunk)
        lengths = [len(answer.scores), *(len(v) for v in answer.parts.values())]
        if answer.errors:
            lengths.append(len(answer.errors))
        if any(length != n for length in lengths):
            raise RemoteRewardError(f"reward server {self.url} answered {lengths} entries for {n} samples ({where})")
        errors = [
            None if err is None else f"{self.url} on {chunk.describe(i)}: {err}"
            for i, err in enumerate(answer.errors or [None] * n)
        ]
        return SourceScores(scores=list(answer.scores), parts=dict(answer.parts), errors=errors)


def _detail(response) -> str:
    try:
        return str(response.json().get("detail", response.text))[:500]
    except (ValueError, AttributeError):
        return response.text[:500]
