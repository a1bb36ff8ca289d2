"""The reward server: a FastAPI app answering ``POST /score`` with any reward function or reward model.

Why FastAPI + uvicorn: both are maintained, already dependencies of the serving stack (vLLM), and uvicorn's single
event loop runs in the main thread, where math-verify's signal-based timeout works.

Everything a client sends is untrusted: the body size is capped while it is read (not after), the JSON is
validated against a strict schema, images are checked before decoding, and every refusal is a 4xx with a message
naming the field and sample. A scorer that fails on the whole batch is a 500 with its message (and logged); a
scorer failing on single samples reports them in ``errors`` so the client's failure policy applies.
"""

from __future__ import annotations

import hmac
import logging
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mmrlhf.rewards.types import RewardBatch, SourceScores
from mmrlhf.rewards.wire import ScoreResponse, ServerLimits, WireError, decode_image, parse_request

logger = logging.getLogger(__name__)

Scorer = Callable[[RewardBatch], Awaitable[SourceScores]]
"""What the server serves: an async callable scoring a batch (see ``mmrlhf.rewards.sources``)."""


def build_app(scorer: Scorer, *, token: str | None = None, limits: ServerLimits | None = None, name: str = "reward"):
    """The ASGI app. ``token``: if set, requests must send ``Authorization: Bearer <token>`` (else 401)."""
    limits = limits or ServerLimits()
    app = FastAPI(title=f"mmrlhf reward server ({name})", docs_url=None, redoc_url=None, openapi_url=None)

    def refuse(status: int, message: str) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"detail": message}, status_code=status, headers=headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "reward": name}

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        if token is not None and not _authorized(request.headers.get("authorization", ""), token):
            return refuse(401, "missing or wrong bearer token")
        try:
            body = await _read_capped(request, limits.max_body_bytes)
            batch = _to_batch(parse_request(body, limits), limits)
        except WireError as exc:
            return refuse(exc.status, str(exc))
        try:
            result = await scorer(batch)
            if len(result.scores) != len(batch):
                raise RuntimeError(f"scorer returned {len(result.scores)} scores for {len(batch)} samples")
        except Exception as exc:  # noqa: BLE001 - reported to the client and logged, the server keeps serving
            logger.exception("reward %r failed on a batch of %d", name, len(batch))
            return refuse(500, f"reward {name!r} failed: {type(exc).__name__}: {exc}")
        payload = ScoreResponse(scores=result.scores, parts=result.parts, errors=result.errors)
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
