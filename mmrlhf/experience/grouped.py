"""The grouped (shared-prompt) layout: each prompt, with its vision inputs, once per row, followed by the responses
sampled from it.

Why: GRPO samples every prompt n times, and in multimodal RL the prompt (hundreds to thousands of vision tokens)
dominates the sequence. The padded and packed layouts repeat prompt and images for every sample, so every trainer
forward and backward runs the vision tower and the prompt n times per group. Here a row is

    [ prompt | response 1 | response 2 | ... | response k | padding ]

and the model sees it with an attention pattern in which a prompt token sees the earlier prompt tokens, and a
response token sees the prompt and the earlier tokens of ITS OWN response, never a sibling's (the mask is built by
:func:`mmrlhf.models.shared_prompt.grouped_attention_mask`), with positions that continue from the prompt exactly
as in the sample's own sequence (:func:`mmrlhf.models.positions.grouped_position_ids`). Every response token's
hidden state is then the one the per-sample sequence gives; the prompt's hidden states and the vision features are
computed once, and autograd sums the gradient every response sends into them, as the per-sample computation does.

Samples share a row when their prompt ids are equal and their vision tensors are equal (grouping never relies on
a group label). A row holds as many responses as fit ``max_row_tokens`` (at least one): attention over a row is
dense, so the budget bounds its quadratic cost and mask memory when responses are long.

The batch type, ``GroupedSamples``, lives with the models that read it (:mod:`mmrlhf.models.batch`).
Pure functions: no model, no device. The forward returns [B, A] tensors in the samples' ORIGINAL order, so callers
see the same result as with the other layouts.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from mmrlhf.experience.samples import BuiltSamples, _concat_vision, _prepare, mm_token_type_ids, routed_rows
from mmrlhf.models.adapters import FamilyAdapter
from mmrlhf.models.batch import PADDING, PROMPT, GroupedSamples


def vision_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Same keys and equal tensors: equal prompt ids with different images must not share a prompt. The same
    storage (one processed image shared by a group's samples) is equal without reading it."""
    keys = {k for k, v in a.items() if v is not None} | {k for k, v in b.items() if v is not None}
    for k in keys:
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            return False
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        if x.shape != y.shape:
            return False
        same = x.data_ptr() == y.data_ptr() and x.stride() == y.stride() and x.dtype == y.dtype
        if not same and not torch.equal(x, y):
            return False
    return True


def group_by_prompt(prompts: Sequence[Sequence[int]], vision: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Indices of samples that share a prompt (equal ids and equal vision tensors), groups in order of first
    appearance, members in sample order."""
    groups: list[list[int]] = []
    by_ids: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> candidate groups
    for i, ids in enumerate(prompts):
        candidates = by_ids.setdefault(tuple(ids), [])
        for g in candidates:
            if vision_equal(vision[groups[g][0]], vision[i]):
                groups[g].append(i)
                break
        else:
            candidates.append(len(groups))
            groups.append([i])
    return groups


def _rows(groups: list[list[int]], prompt_len: list[int], response_len: list[int],
          max_row_tokens: int | None) -> list[list[int]]:
    """Split each group's samples into rows of at most ``max_row_tokens`` tokens (a row holds at least one)."""
    rows = []
    for members in groups:
        row: list[int] = []
        used = prompt_len[members[0]]
        for i in members:
            if row and max_row_tokens is not None and used + response_len[i] > max_row_tokens:
                rows.append(row)
                row, used = [], prompt_len[members[0]]
            row.append(i)
            used += response_len[i]
        rows.append(row)
    return rows


def split_vision(vision: dict[str, Any], prompt_ids: Sequence[int], adapter: FamilyAdapter
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A multi-turn sample's vision dict split into its prompt's part and its response's (observation images, which
    follow the prompt's images in the dict as their pads follow in the ids). Videos and per-video extras belong to
    the prompt (observations carry images only)."""
    grid = vision.get("image_grid_thw")
    if grid is None:
        return dict(vision), {}
    grid = torch.as_tensor(grid).reshape(-1, 3)
    pads = int(sum(1 for t in prompt_ids if t == adapter.image_token_id))
    tokens = adapter.tokens_per_grid(grid).tolist()
    k, seen = 0, 0
    while k < len(tokens) and seen < pads:
        seen += int(tokens[k])
        k += 1
    if seen != pads:
        raise ValueError(f"the prompt's {pads} image pad tokens do not match whole images of the vision dict")
    rows = grid.prod(dim=-1).tolist()
    cut = int(sum(rows[:k]))
    pixels = torch.as_tensor(vision["pixel_values"])
    prompt = {key: v for key, v in vision.items() if key not in ("pixel_values", "image_grid_thw")}
    response: dict[str, Any] = {}
    if k:
        prompt["pixel_values"], prompt["image_grid_thw"] = pixels[:cut], grid[:k]
    if k < len(tokens):
        response["pixel_values"], response["image_grid_thw"] = pixels[cut:], grid[k:]
    return prompt, response


def build_grouped_samples(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int | Iterable[int],
    adapter: FamilyAdapter,
    vision: Sequence[dict[str, Any]] | None = None,
    max_row_tokens: int | None = None,
    response_masks: Sequence[Sequence[int]] | None = None,
    routed_experts: Sequence[Any] | None = None,
) -> BuiltSamples:
    """Grouped layout of the samples (same inputs as ``build_padded_samples`` / ``build_packed_samples``).

    ``routed_experts``: per sample the engine's [tokens, L, k] expert choice over its prompt + response
    (``rollout.routing_replay``), laid out like ``sequences`` ([G, L_row, L, k], -1 at padding): each response's
    own, and for the shared prompt the row's first sample's (the prompt runs once here; an engine that computes a
    group's prompt once, with prefix caching, routed it once too).

    ``vision``: per-sample processor dicts; per-video extras (e.g. ``second_per_grid_ts``) may ride in them and come
    back, per row, as ``BuiltSamples.vision_extra``. Single-turn samples: raises ``ValueError`` naming the sample
    when a response holds an image or video token. Multi-turn samples (``response_masks``: 1 policy, 0 observation
    token): a group shares its FIRST prompt and its images; each response brings its own observation images (the
    tail of its vision dict, :func:`split_vision`), placed in the row in column order, and ``action_mask`` marks
    the policy tokens.
    """
    prompts, responses, truncated, masks = _prepare(prompt_ids, response_ids, eos_id, response_masks)
    batch = len(prompts)
    vision = list(vision) if vision is not None else [{} for _ in range(batch)]
    if len(vision) != batch:
        raise ValueError(f"{len(vision)} vision dicts for {batch} samples")
    if masks is None:
        prompt_vision, response_vision = vision, [{} for _ in range(batch)]
    else:
        halves = []
        for i, v in enumerate(vision):
            try:
                halves.append(split_vision(v, prompts[i], adapter))
            except ValueError as exc:
                raise ValueError(f"sample {i}: {exc}") from exc
        prompt_vision, response_vision = [h[0] for h in halves], [h[1] for h in halves]
    p_len, r_len = [len(p) for p in prompts], [len(r) for r in responses]
    rows = _rows(group_by_prompt(prompts, prompt_vision), p_len, r_len, max_row_tokens)
    width = max(p_len[row[0]] + sum(r_len[i] for i in row) for row in rows)
    sequences = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [G, L]
    segments = torch.full((len(rows), width), PADDING, dtype=torch.long)  # [G, L]
    sample_row = torch.zeros(batch, dtype=torch.long)  # [B]
    sample_start = torch.zeros(batch, dtype=torch.long)  # [B]
    routing = routed_rows(routed_experts, [p + r for p, r in zip(p_len, r_len)])  # [len_i, L, k] each, or None
    routed = None if routing is None else torch.full((len(rows), width, *routing[0].shape[1:]), -1,
                                                     dtype=torch.int16)  # [G, L_row, L, k]
    for g, row in enumerate(rows):
        prompt = prompts[row[0]]
        sequences[g, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        segments[g, : len(prompt)] = PROMPT
        if routed is not None:
            routed[g, : len(prompt)] = routing[row[0]][: len(prompt)]
        col = len(prompt)
        for k, i in enumerate(row, start=1):
            sequences[g, col: col + r_len[i]] = torch.tensor(responses[i], dtype=torch.long)
            segments[g, col: col + r_len[i]] = k
            if routed is not None:
                routed[g, col: col + r_len[i]] = routing[i][p_len[i]:]
            sample_row[i], sample_start[i] = g, col
            col += r_len[i]
    types = mm_token_type_ids(sequences, adapter)  # [G, L]
    vision_in_response = (types != 0) & (segments > PROMPT)  # [G, L]
    if masks is None and bool(vision_in_response.any()):
        g, col = (int(x) for x in torch.nonzero(vision_in_response)[0])
        i = rows[g][int(segments[g, col]) - 1]
        raise ValueError(f"sample {i}: its response holds image / video tokens; the grouped layout (shared "
                         "prompt) needs text-only responses")
    types = types * (segments != PADDING)  # padding is text
    row_vision = [_merge_vision([prompt_vision[row[0]]] + [response_vision[i] for i in row]) for row in rows]
    row_ids = [sequences[g][segments[g] != PADDING].tolist() for g in range(len(rows))]
    fields, extra = _concat_vision(row_vision, len(rows), adapter, row_ids)
    action_mask = None
    if masks is not None:
        action_mask = torch.zeros((batch, max(r_len)), dtype=torch.bool)  # [B, A]
        for i, m in enumerate(masks):
            action_mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    samples = GroupedSamples(
        sequences=sequences,
        segment_ids=segments,
        mm_token_type_ids=types,
        prompt_lengths=torch.tensor([p_len[row[0]] for row in rows], dtype=torch.long),
        sample_row=sample_row,
        sample_start=sample_start,
        response_length=torch.tensor(r_len, dtype=torch.long),
        total_length=torch.tensor([p + r for p, r in zip(p_len, r_len)], dtype=torch.long),
        action_mask=action_mask,
        routed_experts=routed,
        **fields,
    )
    return BuiltSamples(samples, truncated, extra)  # type: ignore[arg-type]


def _merge_vision(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Vision dicts of one row (its prompt's, then each response's observation images) as one, in that order."""
    if len(parts) == 1 or not any(p for p in parts[1:]):
        return parts[0]
    out = dict(parts[0])
    for key in ("pixel_values", "image_grid_thw"):
        pieces = [torch.as_tensor(p[key]) for p in parts if key in p]
        if pieces:
            out[key] = torch.cat(pieces, dim=0)
    return out
