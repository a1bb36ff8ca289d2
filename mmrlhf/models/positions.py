"""M-RoPE (3-D temporal/height/width) position ids for the padded and the packed layout.

The placement rule is the rollout engine's (:mod:`mmrlhf.models.mrope`, per-family layout in
:meth:`FamilyAdapter.rope_units`), reached through :meth:`FamilyAdapter.rope_index`, so both layouts score the
sequence the engine sampled. This module only decides what each call sees:

- padded: one call for the whole batch with the 0/1 attention mask (padding gets position 0 and is never attended);
- packed: one call per sample on that sample's own tokens and vision items, so its positions restart at 0 exactly
  as if it were alone, then the samples are concatenated. A fourth row (first) carries plain per-sample text
  positions: transformers reads it to build the block-diagonal causal mask of packed sequences;
- grouped (shared prompt): one call per row on its prompt and longest response; every response of the row takes
  the positions that follow the prompt, as in its own sequence (the mask comes from ``shared_prompt``).

Always passing explicit positions matters: for a text-only batch transformers would otherwise use ``arange(S)``,
which ignores left padding.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrlhf.models.adapters import FamilyAdapter
from mmrlhf.models.batch import SamplesVL, split_vision_inputs


def padded_position_ids(
    adapter: FamilyAdapter, samples: SamplesVL, vision_extra: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """[3, B, S] M-RoPE positions of a padded batch (``samples.sequences`` [B, S])."""
    return adapter.rope_index(
        samples.sequences,  # [B, S]
        samples.mm_token_type_ids,  # [B, S]
        image_grid_thw=samples.image_grid_thws,  # [total images, 3] in sample order
        video_grid_thw=samples.video_grid_thws,  # [total videos, 3]
        attention_mask=samples.attention_mask,  # [B, S] 0/1
        **(vision_extra or {}),
    )


def _split_extra(extra: dict[str, torch.Tensor] | None, video_num: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per-video extra inputs (e.g. second_per_grid_ts [total videos]) split by each sample's video count."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in video_num]
    for key, values in (extra or {}).items():
        for i, part in enumerate(torch.split(values, video_num)):
            if part.numel():
                out[i][key] = part
    return out


def packed_position_ids(
    adapter: FamilyAdapter, samples: SamplesVL, vision_extra: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """[4, 1, T] positions of a packed batch: row 0 per-sample text positions, rows 1..3 M-RoPE (t, h, w)."""
    ids = samples.sequences[0]  # [T]
    types = samples.mm_token_type_ids[0]  # [T]
    lens = samples.packed_seq_lens.tolist()  # B lengths
    batch = len(lens)
    vision = split_vision_inputs(
        samples.image_num or [0] * batch, samples.video_num or [0] * batch, samples.pixel_values,
        samples.image_grid_thws, samples.pixel_values_videos, samples.video_grid_thws,
    )
    extras = _split_extra(vision_extra, samples.video_num or [0] * batch)
    rows = []
    for i, (sample_ids, sample_types) in enumerate(zip(torch.split(ids, lens), torch.split(types, lens))):
        try:
            mrope = adapter.rope_index(
                sample_ids[None],  # [1, L_i]
                sample_types[None],  # [1, L_i]
                image_grid_thw=vision[i].get("image_grid_thw"),
                video_grid_thw=vision[i].get("video_grid_thw"),
                attention_mask=None,
                **extras[i],
            )  # [3, 1, L_i]
        except ValueError as exc:
            raise ValueError(f"packed sample {i}: {exc}") from exc
        text = torch.arange(len(sample_ids), device=ids.device, dtype=mrope.dtype).view(1, 1, -1)  # [1, 1, L_i]
        rows.append(torch.cat([text, mrope], dim=0))  # [4, 1, L_i]
    return torch.cat(rows, dim=2)  # [4, 1, T]


def grouped_position_ids(
    adapter: FamilyAdapter, samples: Any, vision_extra: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """[3, G, L] M-RoPE positions of a grouped batch (:class:`~mmrlhf.models.batch.GroupedSamples`).

    Every response continues from its prompt exactly as in its own sequence: one rule call per row on the prompt
    followed by the row's longest response (positions depend on token TYPES only, and responses are text), then
    response k of the row takes the positions of the first ``len(k)`` tokens after the prompt. Padding gets 0.
    A row whose responses hold observation images (multi-turn) takes one call per response instead, on the prompt
    and that response with their own images (:func:`_grouped_row_per_response`).
    """
    seqs, types, segments = samples.sequences, samples.mm_token_type_ids, samples.segment_ids  # [G, L] each
    rows, width = seqs.shape
    vision = split_vision_inputs(
        samples.image_num or [0] * rows, samples.video_num or [0] * rows, samples.pixel_values,
        samples.image_grid_thws, samples.pixel_values_videos, samples.video_grid_thws,
    )
    extras = _split_extra(vision_extra, samples.video_num or [0] * rows)
    out = torch.zeros(3, rows, width, dtype=torch.long, device=seqs.device)  # [3, G, L]
    prompt_len = samples.prompt_lengths.tolist()
    for g in range(rows):
        p = prompt_len[g]
        seg = segments[g]  # [L]
        if bool(((types[g] != 0) & (seg > 0)).any()):  # multi-turn responses with observation images
            _grouped_row_per_response(adapter, out, g, seqs[g], types[g], seg, p, vision[g], extras[g])
            continue
        longest = int(torch.bincount(seg[seg > 0]).max()) if bool((seg > 0).any()) else 0
        first = int(torch.nonzero(seg > 0)[0]) if longest else p
        row_types = torch.cat([types[g, :p], types.new_zeros(longest)])  # [p + longest] responses are text
        row_ids = torch.cat([seqs[g, :p], seqs[g, first: first + 1].expand(longest)])  # ids only carry the device
        try:
            pos = adapter.rope_index(row_ids[None], row_types[None], image_grid_thw=vision[g].get("image_grid_thw"),
                                     video_grid_thw=vision[g].get("video_grid_thw"), attention_mask=None,
                                     **extras[g])[:, 0]  # [3, p + longest]
        except ValueError as exc:
            raise ValueError(f"grouped row {g}: {exc}") from exc
        out[:, g, :p] = pos[:, :p]
        for k in range(1, int(seg.max()) + 1):
            cols = torch.nonzero(seg == k).reshape(-1)  # [R_k] consecutive columns of response k
            out[:, g, cols] = pos[:, p: p + cols.numel()]
    return out


def _grouped_row_per_response(adapter: FamilyAdapter, out: torch.Tensor, g: int, ids: torch.Tensor,
                              types: torch.Tensor, seg: torch.Tensor, p: int, vision: dict[str, torch.Tensor],
                              extra: dict[str, torch.Tensor]) -> None:
    """Positions of row ``g`` when its responses carry images: each response's own sequence (the prompt, then the
    response, with the prompt's images followed by the response's) goes through the rule once, exactly as the
    padded and packed layouts place it. The row's image grids are the prompt's, then each response's in column
    order (:mod:`mmrlhf.experience.grouped`)."""
    grid = vision.get("image_grid_thw")
    tokens = adapter.tokens_per_grid(grid).tolist() if grid is not None else []

    def take(start: int, pads: int) -> int:  # how many whole images from ``start`` hold ``pads`` pad tokens
        k, seen = 0, 0
        while seen < pads:
            if start + k >= len(tokens):
                raise ValueError(f"grouped row {g}: {pads} image pad tokens but too few image grids")
            seen += int(tokens[start + k])
            k += 1
        if seen != pads:
            raise ValueError(f"grouped row {g}: {pads} image pad tokens do not match whole image grids")
        return k

    prompt_images = take(0, int((types[:p] == 1).sum()))
    cursor = prompt_images
    for k in range(1, int(seg.max()) + 1):
        cols = torch.nonzero(seg == k).reshape(-1)  # [R_k] consecutive columns of response k
        own = take(cursor, int((types[cols] == 1).sum()))
        grids = None
        if grid is not None and prompt_images + own:
            grids = torch.cat([grid[:prompt_images], grid[cursor: cursor + own]], dim=0)  # [images of the sample, 3]
        cursor += own
        try:
            pos = adapter.rope_index(torch.cat([ids[:p], ids[cols]])[None], torch.cat([types[:p], types[cols]])[None],
                                     image_grid_thw=grids, video_grid_thw=vision.get("video_grid_thw"),
                                     attention_mask=None, **extra)[:, 0]  # [3, p + R_k]
        except ValueError as exc:
            raise ValueError(f"grouped row {g}, response {k}: {exc}") from exc
        out[:, g, :p] = pos[:, :p]
        out[:, g, cols] = pos[:, p:]
