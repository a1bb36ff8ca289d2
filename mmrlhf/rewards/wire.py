"""The JSON protocol between the remote reward client and ``mmrlhf serve-reward``, and image (de)coding.

Request  ``POST /score``::

    {"responses": [str], "prompts": [str], "labels": [str], "references": [str | null],
     "extra": {column: [value]}, "images": [[base64 PNG/JPEG, ...] per sample] | null}

Response ``200``::

    {"scores": [float | null], "parts": {name: [float | null]}, "errors": [str | null]}

One entry per sample, in request order. ``errors[i]`` carries a per-sample failure (the function raised on it,
returned NaN, ...) so the client's failure policy sees it as such instead of the whole request failing.

Why JSON + base64 and not pickle: the server accepts data from the network; JSON cannot execute code, and images
are decoded by PIL only after their encoded size, format and pixel count are checked.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


class WireError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may carry (the server answers 413 / 422 beyond them)."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_batch: int = 1024
    max_text_chars: int = 200_000
    max_images_per_sample: int = 16
    max_image_bytes: int = 8 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    responses: list[str]
    prompts: list[str]
    labels: list[str]
    references: list[str | None]
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
    model_config = ConfigDict(extra="forbid")

    scores: list[float | None]
    parts: dict[str, list[float | None]] = Field(default_factory=dict)
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
    for field in ("responses", "prompts"):
        for i, text in enumerate(getattr(request, field)):
            if len(text) > limits.max_text_chars:
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


def encode_image(image: Any) -> str:
    """Base64 PNG of a PIL image (lossless, so a remote model sees what a local one would)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
