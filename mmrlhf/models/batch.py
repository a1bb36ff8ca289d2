"""The batches a model forward reads: ``Samples`` / ``SamplesVL`` (padded or packed) and ``GroupedSamples`` (one
shared prompt per row), plus the tensor walk (device moves, pinning) every batch type of the framework shares.

They live with the models because ``ActorVL`` / ``CriticVL`` read them; the experience makers build them
(:mod:`mmrlhf.experience.samples`, :mod:`mmrlhf.experience.grouped`) and derive ``Experience`` from them
(:mod:`mmrlhf.experience.types`).

Names and layouts follow what users know from the field (OpenRLHF / LightRFT / ColossalChat):

- batched form: ``sequences`` [B, S] = left-padded prompt + right-padded response; ``action_mask`` [B, A] marks
  response tokens up to and including EOS, A = the longest response of the batch;
- packed form: ``sequences`` [1, T] with no padding, T = sum of per-sample lengths; ``attention_mask`` [1, T]
  holds the 1-based index of the sample each token belongs to; ``packed_seq_lens`` [B] gives the lengths;
  ``num_actions`` [B] the response lengths;
- grouped form: see :mod:`mmrlhf.experience.grouped` (why and how rows are built).

Vision inputs are kept concatenated in processor order (``pixel_values`` [sum of image patch rows, D],
``image_grid_thws`` [total images, 3], ...) together with per-sample counts; :meth:`SamplesVL.vision_inputs`
slices one sample's tensors by the products of its grid rows, so every sample can re-run its exact forward.

Plain dataclasses with no reference to engines or models: a batch can be shipped to another process.
``to_device`` / ``pin_memory`` walk every field, including lists and dicts of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor inside ``obj`` (tensors, lists, tuples, dicts; other values unchanged)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else t.pin_memory()


class TensorContainer:
    """Mixin: device moves and pinning over all dataclass fields (the batches here and ``Experience``)."""

    @torch.no_grad()
    def to_device(self, device: torch.device | str):
        """Move every tensor field (lists / dicts of tensors included) to ``device``, in place; returns self."""
        for f in fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, _map_tensors(getattr(self, f.name), lambda t: t.to(device)))
        return self

    def pin_memory(self):
        """Pin every CPU tensor field for faster host-to-device copies, in place; returns self.

        Raises where the platform cannot pin (no accelerator runtime): callers check
        ``torch.cuda.is_available()`` (or their accelerator's equivalent) first.
        """
        for f in fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, _map_tensors(getattr(self, f.name), _pin))
        return self


@dataclass
class Samples(TensorContainer):
    """Generated sequences of one micro-batch, before any model scored them (text-only form)."""

    sequences: torch.Tensor  # [B, S] batched | [1, T] packed; prompt + response token ids
    attention_mask: torch.Tensor | None  # [B, S] 0/1 batched | [1, T] 1-based sample index packed
    action_mask: torch.Tensor | None  # [B, A] bool, response tokens (through EOS) | None packed; multi-turn samples
    #   (any layout): the POLICY tokens only (observation tokens False)
    num_actions: int | torch.Tensor  # A (batched) | [B] response lengths (packed)
    packed_seq_lens: torch.Tensor | None  # [B] total length of each packed sample | None batched
    response_length: torch.Tensor  # [B] response tokens per sample (EOS included)
    total_length: torch.Tensor  # [B] prompt + response tokens per sample (no padding)
    prompts: list[str] = field(default_factory=list)  # B prompt texts (after the chat template)
    labels: list[str | None] = field(default_factory=list)  # B labels (select the reward recipe)
    pad_len: int | None = None  # padding added when a packed batch is padded to a fixed size

    @property
    def packed(self) -> bool:
        return self.packed_seq_lens is not None

    @property
    def batch_size(self) -> int:
        return int(self.response_length.shape[0])


@dataclass
class SamplesVL(Samples):
    """Samples of a vision-language model: adds the vision inputs each sample needs for its forward."""

    pixel_values: torch.Tensor | None = None  # [sum of image patch rows, D], all images in sample order
    image_grid_thws: torch.Tensor | None = None  # [total images, 3] (t, h, w) patches per image
    pixel_values_videos: torch.Tensor | None = None  # [sum of video patch rows, D]
    video_grid_thws: torch.Tensor | None = None  # [total videos, 3]
    mm_token_type_ids: torch.Tensor | None = None  # same shape as sequences; 1 image / 2 video pad tokens, else 0
    image_num: list[int] = field(default_factory=list)  # B images per sample
    video_num: list[int] = field(default_factory=list)  # B videos per sample
    raw_images: list[list[Any]] | None = None  # B lists of PIL images (for engines / reports)
    references: list[str | None] | None = None  # B ground-truth answers
    # The experts the rollout engine routed each token to (rollout.routing_replay; mixture-of-experts families):
    # [B, S, L, k] padded | [1, T, L, k] packed (L = decoder layers, k = experts per token), int16, laid out like
    # ``sequences``; -1 where the engine ran no routing (padding, each sample's last token). None: not recorded.
    routed_experts: torch.Tensor | None = None

    def vision_inputs(self, index: int) -> dict[str, torch.Tensor]:
        """One sample's vision tensors, sliced by the products of its grid rows (empty dict if it has none)."""
        return slice_vision(
            index, self.image_num, self.video_num, self.pixel_values, self.image_grid_thws,
            self.pixel_values_videos, self.video_grid_thws,
        )


def _row_offsets(grid: torch.Tensor | None, counts: list[int], index: int) -> tuple[int, int, int, int]:
    """(first grid row, last grid row, first patch row, last patch row) of sample ``index``."""
    g0 = sum(counts[:index])
    g1 = g0 + counts[index]
    if grid is None or g1 == g0:
        return g0, g1, 0, 0
    rows = grid.prod(dim=-1)  # [N] patch rows per item
    p0 = int(rows[:g0].sum())
    return g0, g1, p0, p0 + int(rows[g0:g1].sum())


def slice_vision(index, image_num, video_num, pixel_values, image_grid, pixel_values_videos, video_grid):
    """Sample ``index``'s vision tensors out of the concatenated ones (the ``vision_inputs`` of every batch type)."""
    out: dict[str, torch.Tensor] = {}
    if image_num and image_num[index] > 0:
        g0, g1, p0, p1 = _row_offsets(image_grid, image_num, index)
        out["pixel_values"] = pixel_values[p0:p1]
        out["image_grid_thw"] = image_grid[g0:g1]
    if video_num and video_num[index] > 0:
        g0, g1, p0, p1 = _row_offsets(video_grid, video_num, index)
        out["pixel_values_videos"] = pixel_values_videos[p0:p1]
        out["video_grid_thw"] = video_grid[g0:g1]
    return out


def split_vision_inputs(
    image_num: list[int],
    video_num: list[int],
    pixel_values: torch.Tensor | None,
    image_grid_thws: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thws: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """All samples' vision dicts in one linear pass (``vision_inputs(i)`` for every i, without the O(B^2))."""
    batch = max(len(image_num), len(video_num))
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(batch)]
    for counts, values, grid, value_key, grid_key in (
        (image_num, pixel_values, image_grid_thws, "pixel_values", "image_grid_thw"),
        (video_num, pixel_values_videos, video_grid_thws, "pixel_values_videos", "video_grid_thw"),
    ):
        if not counts or grid is None:
            continue
        rows = grid.prod(dim=-1).tolist()  # patch rows per item
        g = p = 0
        for i, n in enumerate(counts):
            if n:
                span = sum(rows[g : g + n])
                out[i][value_key] = values[p : p + span]
                out[i][grid_key] = grid[g : g + n]
                g, p = g + n, p + span
        if g != grid.shape[0] or p != values.shape[0]:
            raise ValueError(
                f"{grid_key}: per-sample counts cover {g} of {grid.shape[0]} grid rows and {p} of "
                f"{values.shape[0]} patch rows; counts and tensors disagree"
            )
    return out


PROMPT, PADDING = 0, -1  # segment ids; response k of a row is segment k (1-based)


@dataclass
class GroupedSamples(TensorContainer):
    """Samples laid out one shared prompt per row (built and explained by :mod:`mmrlhf.experience.grouped`)."""

    sequences: torch.Tensor  # [G, L] row = prompt + its responses + right padding (pad id)
    segment_ids: torch.Tensor  # [G, L] long: 0 prompt, k >= 1 the row's k-th response, -1 padding
    mm_token_type_ids: torch.Tensor  # [G, L] 1 image / 2 video pad tokens, else 0
    prompt_lengths: torch.Tensor  # [G] prompt tokens of each row
    sample_row: torch.Tensor  # [B] row holding each sample
    sample_start: torch.Tensor  # [B] column of each sample's first response token
    response_length: torch.Tensor  # [B] response tokens per sample (through its stop token)
    total_length: torch.Tensor  # [B] prompt + response tokens per sample (its own sequence)
    pixel_values: torch.Tensor | None = None  # [patch rows of the G rows' images, D], row order (in a row: the
    #   prompt's images, then each response's observation images in column order)
    image_grid_thws: torch.Tensor | None = None  # [images of the G rows, 3], same order
    pixel_values_videos: torch.Tensor | None = None  # [patch rows of the G prompts' videos, D]
    video_grid_thws: torch.Tensor | None = None  # [videos of the G prompts, 3]
    image_num: list[int] = field(default_factory=list)  # G images per row
    video_num: list[int] = field(default_factory=list)  # G videos per row
    action_mask: torch.Tensor | None = None  # [B, A] bool policy tokens of multi-turn responses (None: all scored)
    routed_experts: torch.Tensor | None = None  # [G, L, layers, k] int16 the engine's experts per token (-1: none)

    @property
    def batch_size(self) -> int:
        return int(self.response_length.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.sequences.shape[0])


def pad_positions(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, A_i, ...] -> [B, width, ...], zero / False padded on the right of the position dimension (per-token
    tensors with trailing dimensions, e.g. a teacher's top-k [B, A, k], pad where [B, A] ones do)."""
    return torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, width - x.shape[1]))
