"""``data``: where prompts come from, how their images / videos are loaded, and how they are tokenised."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from mmrlhf.config.base import Section


class DataConfig(Section):
    prompt_data: list[str] = Field(default_factory=list)
    """Prompt dataset paths (JSONL, Parquet, or a ``datasets.save_to_disk`` folder)."""
    prompt_max_len: int = Field(default=1024, ge=1)
    """Maximum prompt length in tokens (vision tokens included). A longer prompt is handled by ``prompt_overflow``:
    by default its oldest user text is cut, which is counted (the step metric ``truncated_prompts``) and warned once
    per batch (how many, the first one's record and its lengths), never silent: a recipe with a short limit (the zoom
    toy's 64) would otherwise train on questions without their start. ``prompt_overflow: error`` refuses instead."""
    generator: Optional[str] = None
    """Prompts made on the fly instead of (or, for evaluation, besides) files: ``package.module:function`` or
    ``path/to/file.py:function`` with ``fn(index, *, split, **generator_options) -> row`` (a dict shaped like a
    JSONL row; images may be PIL images). Row ``index`` of a split must depend on nothing else (resume and
    evaluation rely on it). Training reads split ``train``, evaluation split ``eval``."""
    generator_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for ``generator`` (e.g. the task variant)."""
    shuffle: bool = True
    """Visit file prompts in a new seeded order every epoch (``trainer.seed``); generated prompts keep index order."""
    restart_stream_on_resume: bool = False
    """``--resume`` over prompt files whose content changed since the checkpoint (sizes, names or bytes: the stream's
    saved fingerprint) is refused, since the saved position would point into a different order; ``true`` starts the
    prompt stream over (epoch 0) on the new data instead, and says so."""
    eval_data: list[str] = Field(default_factory=list)
    """Held-out prompt files for ``trainer.eval_steps``; empty: the ``eval`` split of ``generator`` when set."""
    eval_size: int = Field(default=64, ge=1)
    """Evaluation prompts used (the first ones of ``eval_data`` / the ``eval`` split)."""

    # ---- columns ----------------------------------------------------------------------------------------------
    prompt_key: str = "prompt"
    """Column holding the prompt: plain text (with placeholders) or a list of chat messages."""
    image_key: str = "images"
    """Column holding the record's images (one item or a list); a missing column means no images."""
    video_key: str = "videos"
    """Column holding the record's videos (one path / frame list, or a list of them); missing means no videos."""
    label_key: str = "label"
    """Column holding the label that selects the reward recipe (optional)."""
    reference_key: str = "reference"
    """Column holding the ground-truth answer handed to rewards (optional)."""
    id_key: str = "id"
    """Column holding a record id used in error messages (optional; the row index is always given too)."""
    image_placeholder: str = "<image>"
    """Marker in a plain-text prompt where the next image goes; one per image, checked per record."""
    video_placeholder: str = "<video>"
    """Marker in a plain-text prompt where the next video goes; one per video, checked per record."""
    apply_chat_template: bool = True
    """Render prompts with the model's chat template (off: plain text, placeholders become vision tokens)."""
    system_prompt: Optional[str] = None
    """System message prepended to plain-text prompts when the chat template is applied (None: none)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template, e.g. ``{enable_thinking: false}`` for Qwen3.5's non-thinking mode
    (its template opens a ``<think>`` block by default; rewards read the answer after it). A variable the model's
    template does not read is left out for that model (said once at INFO level), so one recipe serves families whose
    templates differ."""

    # ---- vision knobs (qwen-vl-utils semantics; a per-item dict may override min/max pixels) ---------------------
    image_min_pixels: Optional[int] = Field(default=None, gt=0)
    """Lower bound on an image's pixels after resizing (None: leave it to the model's processor)."""
    image_max_pixels: Optional[int] = Field(default=None, gt=0)
    """Upper bound on an image's pixels after resizing (None: leave it to the model's processor)."""
    image_pixel_limit: int = Field(default=50_000_000, gt=0)
    """Largest source image (width x height) accepted before decoding: guards against decompression bombs."""
    video_fps: float = Field(default=2.0, gt=0.0)
    """Frames sampled per second of video (ignored when ``video_nframes`` is set)."""
    video_nframes: Optional[int] = Field(default=None, ge=1)
    """Fixed number of frames sampled per video (None: use ``video_fps``)."""
    video_min_frames: int = Field(default=4, ge=1)
    """Fewest frames sampled from a video when sampling by fps (capped by the video's length)."""
    video_max_frames: int = Field(default=64, ge=1)
    """Most frames sampled from a video (bounds memory and vision tokens)."""
    video_min_pixels: Optional[int] = Field(default=None, gt=0)
    """Lower bound on a video frame's pixels after resizing (None: leave it to the model's processor)."""
    video_max_pixels: Optional[int] = Field(default=None, gt=0)
    """Upper bound on a video frame's pixels after resizing (None: leave it to the model's processor)."""
    video_max_tokens: Optional[int] = Field(default=512, ge=1)
    """Total-pixel budget of ONE video, in vision tokens: its frames are shrunk (aspect kept) so that all of them
    together cost at most this many tokens, as qwen-vl-utils' ``total_pixels`` does (the pixel budget is this times
    ``(patch_size x spatial_merge_size)^2``, from the model's config). The default leaves half of the default
    ``prompt_max_len`` for text; raise both together. A per-item ``total_pixels`` (pixels) or ``max_tokens``
    overrides it. A frame keeps at least ``video_min_pixels`` (default: 4 tokens' worth), so a video with very many
    frames can exceed the budget: lower ``video_max_frames`` then. None: no budget (only per-frame bounds)."""

    # ---- guard rails ------------------------------------------------------------------------------------------
    on_bad_input: Literal["error", "skip"] = "error"
    """Missing / corrupt / oversized / empty vision input or a malformed record: raise naming it, or skip it
    (counted and logged)."""
    prompt_overflow: Literal["truncate_left", "skip", "error"] = "truncate_left"
    """A prompt over ``prompt_max_len``: drop its oldest USER text tokens, skip it, or raise. ``truncate_left`` never
    cuts the system turn (it carries the task's instructions), vision blocks, special tokens or role headers; a
    prompt that cannot fit without them is refused (``prompt_too_long``, per ``on_bad_input``). The prompt text
    handed to engines is rebuilt from the truncated ids."""

    @model_validator(mode="after")
    def _check_bounds(self) -> "DataConfig":
        for lo, hi in (("image_min_pixels", "image_max_pixels"), ("video_min_pixels", "video_max_pixels"),
                       ("video_min_frames", "video_max_frames")):
            lo_v, hi_v = getattr(self, lo), getattr(self, hi)
            if lo_v is not None and hi_v is not None and lo_v > hi_v:
                raise ValueError(f"data.{lo} ({lo_v}) must not exceed data.{hi} ({hi_v})")
        if not self.image_placeholder or not self.video_placeholder:
            raise ValueError("data.image_placeholder and data.video_placeholder must be non-empty")
        if self.image_placeholder == self.video_placeholder:
            raise ValueError("data.image_placeholder and data.video_placeholder must differ")
        return self
