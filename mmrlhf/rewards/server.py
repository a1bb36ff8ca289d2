"""The reward server: a FastAPI app answering ``POST /score`` with any reward function or reward model.

Why FastAPI + uvicorn: both are maintained and already dependencies of the serving stack (vLLM).

Load. The event loop only routes requests: a large body (images) is decoded in a worker thread, a synchronous
reward function runs in the scorer's bounded pool (``FunctionSource`` with ``serve-reward --threads``), a reward
model in its own thread, so ``GET /health`` answers at once however busy the server is (a function marked
``@main_thread``, like ``math_accuracy``, is the exception: it runs on the loop, see ``mmrlhf.rewards.runners``).
At most ``limits.max_concurrent_requests`` requests are decoded and scored at once (which bounds the bytes held in
memory to that many bodies); one more is answered 503 with ``Retry-After``, which the client honours. A request whose
scoring takes over ``limits.request_timeout_s`` is answered 504 (a sync function's thread cannot be stopped: it
finishes in the background, but the pool bounds how many can).

Everything a client sends is untrusted: the body size is capped while it is read (not after), the JSON is
validated against a strict schema, images are checked before decoding, and every refusal is a 4xx with a message
naming the field and sample. A scorer that fails on the whole batch is a 500 with its message (and logged; the
client does not retry it: it would fail again); a scorer failing on single samples reports them in ``errors`` so
the client's failure policy applies. ``/health`` names the reward only to a client holding the token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mmrlhf.rewards.types import RewardBatch, SourceScores
from mmrlhf.rewards.wire import ScoreResponse, ServerLimits, WireError, decode_image, parse_request

logger = logging.getLogger(__name__)

INLINE_DECODE_BYTES = 64 * 1024
"""Bodies up to this size are decoded on the event loop; larger ones (images, long texts) in a worker thread."""

Scorer = Callable[[RewardBatch], Awaitable[SourceScores]]
"""What the server serves: an async callable scoring a batch (see ``mmrlhf.rewards.sources``)."""


def build_app(scorer: Scorer, *, token: str | None = None, limits: ServerLimits | None = None, name: str = "reward"):
    """The ASGI app. ``token``: if set, requests must send ``Authorization: Bearer <token>`` (else 401)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="mmrlhf reward server", docs_url=None, redoc_url=None, openapi_url=None)
    load = {"in_flight": 0}

    def refuse(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        if status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse({"detail": message}, status_code=status, headers=headers)

    def authorized(request: Request) -> bool:
        return token is None or _authorized(request.headers.get("authorization", ""), token)

    @app.get("/health")
    async def health(request: Request) -> dict[str, object]:
        answer: dict[str, object] = {
            "status": "ok", "in_flight": load["in_flight"], "max_concurrent": limits.max_concurrent_requests
        }
        if token is not None and authorized(request):  # the spec may be a file path: only for token holders
            answer["reward"] = name
        return answer

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        if not authorized(request):
            return refuse(401, "missing or wrong bearer token")
        if load["in_flight"] >= limits.max_concurrent_requests:
            return refuse(
                503,
                f"server busy: {limits.max_concurrent_requests} requests in flight; retry later",
                {"Retry-After": str(limits.retry_after_s)},
            )
        load["in_flight"] += 1
        try:
            return await _score(request)
        finally:
            load["in_flight"] -= 1

    async def _score(request: Request) -> JSONResponse:
        try:
            body = await _read_capped(request, limits.max_body_bytes)
            decode = lambda: _to_batch(parse_request(body, limits), limits)  # noqa: E731
            # A small body parses in well under a millisecond: a thread hop would cost more than it saves.
            batch = decode() if len(body) <= INLINE_DECODE_BYTES else await asyncio.to_thread(decode)
        except WireError as exc:
            return refuse(exc.status, str(exc))
        task = asyncio.ensure_future(scorer(batch))
        try:
            done, _ = await asyncio.wait({task}, timeout=limits.request_timeout_s)
        finally:
            if not task.done():  # timed out, or this request was cancelled: stop the work (a thread finishes alone)
                task.cancel()
        if not done:
            logger.warning("reward %r: a batch of %d took over %g s", name, len(batch), limits.request_timeout_s)
            return refuse(504, f"reward {name!r} did not finish within {limits.request_timeout_s:g} s")
        try:
            result = task.result()
            if len(result.scores) != len(batch):
                raise RuntimeError(f"scorer returned {len(result.scores)} scores for {len(batch)} samples")
            payload = ScoreResponse(scores=result.scores, parts=result.parts, errors=result.errors)
        except Exception as exc:  # noqa: BLE001 - reported to the client and logged, the server keeps serving
            logger.exception("reward %r failed on a batch of %d", name, len(batch))
            return refuse(500, f"reward {name!r} failed: {type(exc).__name__}: {exc}")
        return JSONResponse(payload.model_dump())

    return app


def _authorized(header: str, token: str) -> bool:
    scheme, _, given = header.partition(" ")
    # compare_digest: the time taken does not reveal how much of the token matched.
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def _read_capped(request: Request, cap: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise WireError(400, f"invalid Content-Length {declared!r}")
        if int(declared) > cap:
            raise WireError(413, f"request body of {declared} bytes exceeds the limit of {cap}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise WireError(413, f"request body exceeds the limit of {cap} bytes")
        chunks.append(chunk)
    if size == 0:
        raise WireError(400, "empty request body; expected a JSON object")
    return b"".join(chunks)


def _to_batch(request, limits: ServerLimits) -> RewardBatch:
    images = None
    if request.images is not None:
        images = [
            [decode_image(data, limits, f"sample {i} image {j}") for j, data in enumerate(sample)]
            for i, sample in enumerate(request.images)
        ]
    return RewardBatch(
        responses=request.responses,
        prompts=request.prompts,
        labels=request.labels,
        references=request.references,
        extra=dict(request.extra),
        images=images,
    )
