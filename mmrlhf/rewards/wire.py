"""The JSON protocol between the remote reward client and ``mmrlhf serve-reward``, and image (de)coding.

Request  ``POST /score``::

    {"responses": [str], "prompts": [str], "labels": [str], "references": [any JSON value],
     "extra": {column: [value]}, "images": [[base64 PNG/JPEG, ...] per sample] | null}

Response ``200``::

    {"scores": [number | null], "parts": {name: [number | null]}, "errors": [str | null]}

One entry per sample, in request order. ``errors[i]`` carries a per-sample failure (the function raised on it,
returned NaN, ...) so the client's failure policy sees it as such instead of the whole request failing.

References travel as they are (a JSONL ``"answer": 3`` arrives as the int 3, as a local function would get it);
numpy / torch scalars become plain numbers. A reference that is not JSON (an object, NaN) is refused before
sending, naming the sample. Scores must be finite JSON numbers: ``NaN`` / ``Infinity`` (which Python's JSON
reader accepts), strings such as ``"2.5"`` and booleans are never coerced; each such entry is a failure of that
sample, exactly as if a local function had returned it.

Why JSON + base64 and not pickle: the server accepts data from the network; JSON cannot execute code, and images
are decoded by PIL only after their encoded size, format and pixel count are checked.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, ValidationError, model_validator

ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


class WireError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may carry (413 / 422 beyond them) and on the server's load.

    ``max_concurrent_requests`` requests are read and scored at once; one more is answered 503 with a
    ``Retry-After: retry_after_s`` header, so the bytes held in flight are at most that many bodies of
    ``max_body_bytes``. A request whose scoring takes over ``request_timeout_s`` is answered 504.
    """

    max_body_bytes: int = 64 * 1024 * 1024
    max_batch: int = 1024
    max_text_chars: int = 200_000
    max_images_per_sample: int = 16
    max_image_bytes: int = 8 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_concurrent_requests: int = 64
    request_timeout_s: float = 50.0
    retry_after_s: int = 1


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    responses: list[str]
    prompts: list[str]
    labels: list[str]
    references: list[Any]
    extra: dict[str, list[Any]] = Field(default_factory=dict)
    images: list[list[str]] | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> "ScoreRequest":
        n = len(self.responses)
        columns = {"prompts": self.prompts, "labels": self.labels, "references": self.references}
        columns.update({f"extra.{k}": v for k, v in self.extra.items()})
        if self.images is not None:
            columns["images"] = self.images
        for name, column in columns.items():
            if len(column) != n:
                raise ValueError(f"field {name!r} has {len(column)} entries but 'responses' has {n}")
        return self


class ScoreResponse(BaseModel):
    """What the server sends (validated before sending: a non-finite score never leaves it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    scores: list[FiniteFloat | None]
    parts: dict[str, list[FiniteFloat | None]] = Field(default_factory=dict)
    errors: list[str | None] = Field(default_factory=list)


def parse_request(body: bytes, limits: ServerLimits) -> ScoreRequest:
    """Validate a raw request body; raises :class:`WireError` with a 4xx status and a message naming the field."""
    if len(body) > limits.max_body_bytes:
        raise WireError(413, f"request body of {len(body)} bytes exceeds the limit of {limits.max_body_bytes}")
    try:
        request = ScoreRequest.model_validate_json(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise WireError(422, f"malformed request: {problems}") from None
    n = len(request.responses)
    if n > limits.max_batch:
        raise WireError(413, f"batch of {n} samples exceeds the limit of {limits.max_batch}")
    for field in ("responses", "prompts", "references"):
        for i, text in enumerate(getattr(request, field)):
            if isinstance(text, str) and len(text) > limits.max_text_chars:
                raise WireError(413, f"sample {i}: {field} has {len(text)} characters (limit {limits.max_text_chars})")
    for i, images in enumerate(request.images or []):
        if len(images) > limits.max_images_per_sample:
            raise WireError(413, f"sample {i}: {len(images)} images (limit {limits.max_images_per_sample})")
    return request


def decode_image(data: str, limits: ServerLimits, where: str) -> Any:
    """A PIL image from base64 text, after checking size, format and pixel count (``where`` names the sample)."""
    from PIL import Image

    if len(data) > (limits.max_image_bytes * 4) // 3 + 4:
        raise WireError(413, f"{where}: encoded image exceeds {limits.max_image_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(422, f"{where}: image is not valid base64 ({exc})") from None
    try:
        with Image.open(io.BytesIO(raw)) as probe:
            fmt, (width, height) = probe.format, probe.size
            if fmt not in ALLOWED_IMAGE_FORMATS:
                allowed = ", ".join(ALLOWED_IMAGE_FORMATS)
                raise WireError(422, f"{where}: image format {fmt} not allowed (allowed: {allowed})")
            if width * height > limits.max_image_pixels:
                raise WireError(413, f"{where}: image of {width}x{height} pixels exceeds {limits.max_image_pixels}")
            probe.load()
            return probe.copy()
    except WireError:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data; all become a 422 with the cause
        raise WireError(422, f"{where}: cannot decode image ({type(exc).__name__}: {exc})") from None


def encode_image(image: Any, compress_level: int = 6) -> str:
    """Base64 PNG of a PIL image (lossless, so a remote model sees what a local one would). ``compress_level``
    (zlib's 0-9) trades bytes for time only: 1 is about twice as fast as 6 for about 10% more bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=compress_level)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def to_json_value(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (numpy / torch scalars and arrays become numbers and lists).

    Raises ``ValueError`` naming ``where`` for anything JSON cannot carry faithfully (objects, NaN, infinities).
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} cannot be sent as JSON")
        return value
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where}: dict keys must be strings to be sent as JSON")
        return {k: to_json_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if callable(getattr(value, "tolist", None)):  # numpy / torch scalars and arrays
        return to_json_value(value.tolist(), where)
    raise ValueError(f"{where}: a {type(value).__name__} cannot be sent as JSON")


def _wire_score(value: Any) -> tuple[float | None, str | None]:
    """(score, problem) for one answered entry: JSON numbers only, finite; ``null`` is "does not apply"."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None, f"answered a {type(value).__name__} ({json.dumps(value)[:60]}), expected a finite number or null"
    if not math.isfinite(value):
        return None, f"answered a non-finite score ({value})"
    return float(value), None


def decode_answer(content: bytes, n: int) -> tuple[list[float | None], dict[str, list[float | None]], list[str | None]]:
    """(scores, parts, per-sample problems) of a ``200`` answer for ``n`` samples.

    The shape (an object with ``scores`` / ``parts`` / ``errors`` lists of ``n`` entries) is checked first and a
    wrong one raises ``ValueError``: nothing can be aligned then. A bad VALUE (NaN, a string, a boolean) only
    fails its sample: ``problems[i]`` says why (the server's own ``errors[i]`` is reported the same way).
    """
    try:
        answer = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(answer, dict):
        raise ValueError(f"expected a JSON object, got {type(answer).__name__}")
    unknown = sorted(set(answer) - {"scores", "parts", "errors"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    scores_in, parts_in = answer.get("scores"), answer.get("parts") or {}
    errors_in = answer.get("errors") or [None] * n
    if not isinstance(scores_in, list) or not isinstance(parts_in, dict) or not isinstance(errors_in, list):
        raise ValueError("'scores' and 'errors' must be lists and 'parts' an object")
    columns = {"scores": scores_in, "errors": errors_in, **{f"parts.{k}": v for k, v in parts_in.items()}}
    for field, column in columns.items():
        if not isinstance(column, list) or len(column) != n:
            size = f"{len(column)} entries" if isinstance(column, list) else f"a {type(column).__name__}"
            raise ValueError(f"'{field}' has {size} for {n} samples")
    if any(e is not None and not isinstance(e, str) for e in errors_in):
        raise ValueError("'errors' entries must be strings or null")
    problems: list[str | None] = [e for e in errors_in]
    scores: list[float | None] = []
    for i, value in enumerate(scores_in):
        score, problem = _wire_score(value)
        scores.append(score)
        problems[i] = problems[i] or problem
    parts: dict[str, list[float | None]] = {}
    for part, column in parts_in.items():
        parts[part] = []
        for i, value in enumerate(column):
            score, problem = _wire_score(value)
            parts[part].append(score)
            if problem is not None:
                problems[i] = problems[i] or f"part {part!r} {problem}"
    for i, problem in enumerate(problems):
        if problem is not None:  # a failed sample keeps no score (and no parts)
            scores[i] = None
            for column in parts.values():
                column[i] = None
    return scores, parts, problems
