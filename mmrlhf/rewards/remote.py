"""Client for remote reward servers: batching, a concurrency limit, timeouts, retries with backoff and jitter.

A batch is cut into requests of ``batch_size`` samples, at most ``max_concurrency`` in flight.

Retries. What is retried is what can succeed when sent again: connection errors and timeouts, and the statuses in
``RETRY_STATUSES`` (408, 429, 502, 503, 504: the server is busy, restarting, or behind a proxy that lost it).
Everything else is final at once: other 4xx (a malformed request stays malformed) and 500 (``serve-reward``
answers 500 when the reward itself failed on the batch, e.g. a wrong score count, which would repeat). A retry
waits ``backoff_s * 2**attempt`` (capped at ``backoff_max_s``) with "equal jitter" (half fixed, half random) so
clients recovering from one outage do not retry in lockstep; a ``Retry-After`` header is honoured (never sooner).

Budget. All requests of one ``score()`` call share one retry budget: once ``retry_window_s`` seconds have passed
since the call's first failure, no request of it is retried any more (so a batch of many requests cannot multiply
the time spent on an outage), and no request is tried more than ``1 + max_retries`` times. The defaults ride out
a server restart of about 20 s (``serve-reward`` restarts in 3 to 8 s here); raise ``max_retries`` /
``retry_window_s`` for longer outages.

Alignment: each request's answer is checked to have exactly as many entries as it sent and is placed by its chunk
position, so a retried or reordered request can never shift scores onto other samples. Entries that are not finite
numbers fail their sample (see ``mmrlhf.rewards.wire``). If any request finally fails, the whole call raises
:class:`RemoteRewardError` naming the URL and the samples; nothing is half-returned.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from pathlib import Path
from typing import Any

from mmrlhf.rewards.plugins import concat_scores, wait_all_or_first_error
from mmrlhf.rewards.types import RewardBatch, RewardError, RewardInputError, SourceScores
from mmrlhf.rewards.wire import decode_answer, encode_image, to_json_value

RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
"""HTTP statuses worth sending the same request again for (see the module docstring)."""

_sleep = asyncio.sleep  # seams, so tests can record the waits instead of sleeping
_clock = time.monotonic


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


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds asked for by a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _RetryBudget:
    """The retry budget of one ``score()`` call, shared by all its requests."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.deadline: float | None = None

    def remaining(self) -> float:
        """Seconds left for retries; the window starts at the call's first failure."""
        now = _clock()
        if self.deadline is None:
            self.deadline = now + self.window_s
        return self.deadline - now


class RemoteRewardClient:
    """Scores :class:`RewardBatch` es against ``url`` (a ``POST /score`` endpoint, see ``mmrlhf.rewards.wire``)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 8,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        retry_window_s: float = 60.0,
        batch_size: int = 32,
        max_concurrency: int = 8,
        send_images: bool = True,
        seed: int | None = None,
        transport: Any = None,
    ) -> None:
        """``seed`` fixes the jitter; ``transport`` replaces httpx's network transport (tests, custom stacks)."""
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout_s <= 0 or retry_window_s < 0:
            raise ValueError(
                "batch_size and max_concurrency must be >= 1, max_retries >= 0, timeout_s > 0, retry_window_s >= 0"
            )
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.retry_window_s = retry_window_s
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
        budget = _RetryBudget(self.retry_window_s)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(
            timeout=self.timeout_s, headers=headers, limits=limits, transport=self._transport
        ) as client:
            tasks = [
                asyncio.ensure_future(self._post(client, semaphore, budget, body, chunk))
                for body, chunk in zip(payloads, chunks)
            ]
            await wait_all_or_first_error(tasks)
        return concat_scores([task.result() for task in tasks])

    def _payload(self, chunk: RewardBatch) -> bytes:
        def column(values: list[Any], field: str) -> list[Any]:
            try:
                return [to_json_value(v, f"{chunk.describe(i)}: {field}") for i, v in enumerate(values)]
            except ValueError as exc:
                raise RewardInputError(f"cannot send to {self.url}: {exc}") from None

        body: dict[str, Any] = {
            "responses": chunk.responses,
            "prompts": chunk.prompts,
            "labels": chunk.labels,
            "references": column(chunk.references, "references"),
            "extra": {name: column(values, f"extra column {name!r}") for name, values in chunk.extra.items()},
        }
        if self.send_images and chunk.images is not None:
            body["images"] = [[encode_image(img) for img in sample] for sample in chunk.images]
        return json.dumps(body, allow_nan=False).encode()

    async def _post(
        self, client, semaphore: asyncio.Semaphore, budget: _RetryBudget, body: bytes, chunk: RewardBatch
    ) -> SourceScores:
        import httpx

        where = f"{chunk.describe(0)} .. {chunk.describe(len(chunk) - 1)}"
        for attempt in range(self.max_retries + 1):
            async with semaphore:
                self.requests_sent += 1
                try:
                    response = await client.post(self.url, content=body, headers={"Content-Type": "application/json"})
                except httpx.TransportError as exc:  # connect / read errors and timeouts: retry
                    problem, asked = f"{type(exc).__name__}: {exc or 'no detail'}", None
                else:
                    if response.status_code == 200:
                        return self._parse(response, chunk, where)
                    problem = f"HTTP {response.status_code}: {_detail(response)}"
                    if response.status_code not in RETRY_STATUSES:
                        raise RemoteRewardError(
                            f"reward server {self.url} refused the request for {where}: {problem} (not retried: "
                            f"only connection errors, timeouts and HTTP {sorted(RETRY_STATUSES)} are)"
                        )
                    asked = retry_after_seconds(response.headers.get("retry-after"))
            if attempt == self.max_retries:
                break
            delay = max(self.backoff_delay(attempt), asked or 0.0)
            left = budget.remaining()
            if delay > left:
                raise RemoteRewardError(
                    f"reward server {self.url} failed for {where}; the batch's retry window of "
                    f"{self.retry_window_s:g} s is spent (next retry was due in {delay:.1f} s, "
                    f"{max(left, 0):.1f} s left) after {attempt + 1} attempts; last error: {problem}"
                )
            await _sleep(delay)
        raise RemoteRewardError(
            f"reward server {self.url} failed for {where} after {self.max_retries + 1} attempts; last error: "
            f"{problem}"
        )

    def _parse(self, response, chunk: RewardBatch, where: str) -> SourceScores:
        try:
            scores, parts, problems = decode_answer(response.content, len(chunk))
        except ValueError as exc:
            raise RemoteRewardError(f"reward server {self.url} sent a malformed answer for {where}: {exc}") from None
        errors = [
            None if err is None else f"{self.url} on {chunk.describe(i)}: {err}" for i, err in enumerate(problems)
        ]
        return SourceScores(scores=scores, parts=parts, errors=errors)


def _detail(response) -> str:
    try:
        return str(response.json().get("detail", response.text))[:500]
    except (ValueError, AttributeError):
        return response.text[:500]
