"""Data types of the pipeline: a prompt record, a loaded video, and the processor's per-sample output.

Vision tensors travel per sample as ONE dict (``VisionInputs``) holding only the keys that sample has, e.g.
``{"pixel_values": [rows, D], "image_grid_thw": [n_img, 3]}``; a text-only sample has ``{}``. Rows of a sample's
``pixel_values`` are exactly ``image_grid_thw.prod(-1).sum()`` (likewise for videos), so downstream code slices
and concatenates by grid products and never keeps position counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from mmrlhf.data.errors import Skipped, describe_record

# A prompt: plain text (with ``<image>`` / ``<video>`` placeholders) or chat messages
# (``[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "..."}]}]``).
Prompt = Union[str, list]
VisionInputs = dict  # str -> torch.Tensor; see the module docstring for the keys

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")


@dataclass
class PromptRecord:
    """One dataset row after column mapping and placeholder checks; images / videos are not loaded yet."""

    index: int  # row number across the dataset's files, in load order
    prompt: Prompt
    images: list = field(default_factory=list)  # raw items: path, bytes, base64, PIL, {"bytes": ...}, {"image": ...}
    videos: list = field(default_factory=list)  # raw items: path, list of frame images, {"video": ..., "fps": ...}
    label: Any = None
    reference: Any = None
    record_id: Any = None
    base_dir: Optional[str] = None  # relative file paths in this record resolve against it
    source: Optional[str] = None  # the file the row came from (for messages)
    # The row's other columns, by name, as read (plain JSON values): a tool or an environment may need a column the
    # pipeline has no use for (a card's back, a target). One dict per record, shared by its samples, never copied.
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedVideo:
    """A decoded, frame-sampled, resized video. ``frames``: [T, 3, H, W] uint8."""

    frames: torch.Tensor
    fps: float  # frames per second of ``frames`` (after sampling), what the model's temporal position ids need
    frame_indices: list[int]  # indices of the sampled frames in the source
    source: str = ""

    def as_thwc(self) -> torch.Tensor:
        """[T, H, W, 3] uint8: the layout vLLM's ``multi_modal_data["video"]`` takes."""
        return self.frames.permute(0, 2, 3, 1).contiguous()


@dataclass
class MultimodalBatch:
    """Output of :meth:`MultimodalDataProcessor.process_multimodal_batch`, one entry per SAMPLE.

    Samples are the kept prompts in their original order, each repeated ``n_samples_per_prompt`` times
    (sample ``k`` belongs to kept prompt ``k // n``). The n copies of a prompt share its tensors (views into the
    processor's output), its vision dict and its id lists: treat them as read-only.
    """

    n_samples_per_prompt: int
    all_prompt_token_ids: list[list[int]]  # per sample: prompt ids [len_i] (after truncation)
    all_mm_token_type_ids: list[list[int]]  # per sample: [len_i]; 0 text, 1 image pad, 2 video pad
    # per sample: prompt text after the chat template; for a truncated prompt, rebuilt from the kept ids (vision
    # blocks unexpanded), so that the processor on this text and the sample's items gives exactly its prompt ids
    all_prompts: list[str]
    all_images: list[list]  # per sample: loaded PIL images (vLLM ``multi_modal_data["image"]``)
    all_videos: list[list[LoadedVideo]]  # per sample: loaded videos
    all_images_num: list[int]  # per sample: number of images
    all_videos_num: list[int]  # per sample: number of videos
    all_vision_inputs: list[VisionInputs]  # per sample: its own pixel values and grids (see module docstring)
    all_references: list[Any]  # per sample
    all_labels: list[Any]  # per sample
    all_prompt_indices: list[int]  # per sample: index of its prompt in the input batch
    skipped: list[Skipped] = field(default_factory=list)  # input prompts dropped in skip mode, with reasons
    truncated: int = 0  # prompts whose text was shortened to fit ``prompt_max_len``
    all_record_ids: list[Any] = field(default_factory=list)  # per sample: its record's id (None where not given)
    all_positions: list[int] = field(default_factory=list)  # per sample: its prompt's position in the input lists

    def describe_sample(self, k: int) -> str:
        """``record 12 (id='q7'), sample 5``: how messages about sample ``k`` name it (engines, experience maker)."""
        record_id = self.all_record_ids[k] if k < len(self.all_record_ids) else None
        return f"{describe_record(self.all_prompt_indices[k], record_id)}, sample {k}"

    def __len__(self) -> int:
        return len(self.all_prompt_token_ids)

    # ---- batch-level views (the seed's field names), built on demand ------------------------------------------
    def _cat(self, key: str, width: Optional[int]) -> Optional[torch.Tensor]:
        parts = [v[key] for v in self.all_vision_inputs if key in v]
        if not parts:
            return None if width is None else torch.empty((0, width), dtype=torch.long)
        return torch.cat(parts, dim=0)

    @property
    def all_images_grid_thw(self) -> torch.Tensor:
        """[sum(images_num), 3]: every sample's image grids, in sample order."""
        return self._cat("image_grid_thw", 3)

    @property
    def all_videos_grid_thw(self) -> torch.Tensor:
        """[sum(videos_num), 3]: every sample's video grids, in sample order."""
        return self._cat("video_grid_thw", 3)

    @property
    def all_images_pixel_values(self) -> Optional[torch.Tensor]:
        """[sum of image grid products, D] over all samples (a copy: n times the unique rows), or None."""
        return self._cat("pixel_values", None)

    @property
    def all_videos_pixel_values(self) -> Optional[torch.Tensor]:
        """[sum of video grid products, D] over all samples (a copy), or None."""
        return self._cat("pixel_values_videos", None)
