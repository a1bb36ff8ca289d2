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

from typing import Any, Iterable, Sequence

import torch

from mmrlhf.experience.samples import BuiltSamples, _concat_vision, _prepare, mm_token_type_ids
from mmrlhf.models.adapters import FamilyAdapter
from mmrlhf.models.batch import PADDING, PROMPT, GroupedSamples


def _vision_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys and equal tensors: equal prompt ids with different images must not share a prompt."""
    keys = {k for k, v in a.items() if v is not None} | {k for k, v in b.items() if v is not None}
    for k in keys:
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            return False
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        if x.shape != y.shape or not torch.equal(x, y):
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
            if _vision_equal(vision[groups[g][0]], vision[i]):
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


def build_grouped_samples(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int | Iterable[int],
    adapter: FamilyAdapter,
    vision: Sequence[dict[str, Any]] | None = None,
    max_row_tokens: int | None = None,
) -> BuiltSamples:
    """Grouped layout of the samples (same inputs as ``build_padded_samples`` / ``build_packed_samples``).

    ``vision``: per-sample processor dicts; per-video extras (e.g. ``second_per_grid_ts``) may ride in them and come
    back, per row, as ``BuiltSamples.vision_extra``. Raises ``ValueError`` naming the sample when a response holds
    an image or video token (its positions would depend on the vision layout, which the shared prompt cannot give).
    """
    prompts, responses, truncated = _prepare(prompt_ids, response_ids, eos_id)
    batch = len(prompts)
    vision = list(vision) if vision is not None else [{} for _ in range(batch)]
    if len(vision) != batch:
        raise ValueError(f"{len(vision)} vision dicts for {batch} samples")
    p_len, r_len = [len(p) for p in prompts], [len(r) for r in responses]
    rows = _rows(group_by_prompt(prompts, vision), p_len, r_len, max_row_tokens)
    width = max(p_len[row[0]] + sum(r_len[i] for i in row) for row in rows)
    sequences = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [G, L]
    segments = torch.full((len(rows), width), PADDING, dtype=torch.long)  # [G, L]
    sample_row = torch.zeros(batch, dtype=torch.long)  # [B]
    sample_start = torch.zeros(batch, dtype=torch.long)  # [B]
    for g, row in enumerate(rows):
        prompt = prompts[row[0]]
        sequences[g, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        segments[g, : len(prompt)] = PROMPT
        col = len(prompt)
        for k, i in enumerate(row, start=1):
            sequences[g, col: col + r_len[i]] = torch.tensor(responses[i], dtype=torch.long)
            segments[g, col: col + r_len[i]] = k
            sample_row[i], sample_start[i] = g, col
            col += r_len[i]
    types = mm_token_type_ids(sequences, adapter)  # [G, L]
    vision_in_response = (types != 0) & (segments > PROMPT)  # [G, L]
    if bool(vision_in_response.any()):
        g, col = (int(x) for x in torch.nonzero(vision_in_response)[0])
        i = rows[g][int(segments[g, col]) - 1]
        raise ValueError(f"sample {i}: its response holds image / video tokens; the grouped layout (shared "
                         "prompt) needs text-only responses")
    types = types * (segments == PROMPT)  # responses and padding are text
    fields, extra = _concat_vision([vision[row[0]] for row in rows], len(rows), adapter,
                                   [prompts[row[0]] for row in rows])
    samples = GroupedSamples(
        sequences=sequences,
        segment_ids=segments,
        mm_token_type_ids=types,
        prompt_lengths=torch.tensor([p_len[row[0]] for row in rows], dtype=torch.long),
        sample_row=sample_row,
        sample_start=sample_start,
        response_length=torch.tensor(r_len, dtype=torch.long),
        total_length=torch.tensor([p + r for p, r in zip(p_len, r_len)], dtype=torch.long),
        **fields,
    )
    return BuiltSamples(samples, truncated, extra)  # type: ignore[arg-type]
