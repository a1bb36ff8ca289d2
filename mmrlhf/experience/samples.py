"""Builders from per-sample pieces (prompt ids, response ids, vision tensors) to the two batch layouts of
:class:`~mmrlhf.models.batch.SamplesVL`.

Both builders take the same inputs and encode the same samples, so the padded and the packed forward of one batch
must give the same log-probs (the model tests check exactly that). Pure functions: no model, no device.

Stop handling: a response keeps its tokens up to and including its first stop token; anything after it carries no
learning signal (an engine that ignored EOS, or padding a generator wrote) and is dropped, so it is neither scored
nor attended to. A response with no stop token ran into the length limit: it is marked ``truncated`` so rewards and
losses can treat it (e.g. overlong shaping) without re-deriving it from the tokens.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Sequence

import torch

from mmrlhf.models.adapters import FamilyAdapter
from mmrlhf.models.batch import SamplesVL

# Processor keys of one sample's vision dict -> SamplesVL field names (items concatenated in sample order).
_VISION_FIELDS = {
    "pixel_values": "pixel_values",
    "image_grid_thw": "image_grid_thws",
    "pixel_values_videos": "pixel_values_videos",
    "video_grid_thw": "video_grid_thws",
}
# Keys a processor returns that are not model inputs of the vision tower.
_NON_VISION_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids"}

class BuiltSamples(NamedTuple):
    """A built batch: the samples, which responses hit the length limit, and extra per-video vision inputs."""

    samples: SamplesVL
    truncated: torch.Tensor  # [B] bool: the response has no stop token (cut by the length limit)
    vision_extra: dict[str, torch.Tensor]  # e.g. {"second_per_grid_ts": [total videos]}; SamplesVL has no field


def mm_token_type_ids(input_ids: torch.Tensor, adapter: FamilyAdapter) -> torch.Tensor:
    """Modality of every token (see :meth:`FamilyAdapter.mm_token_type_ids`): rebuilt from the ids rather than
    carried from the processor because responses (and padding) are appended after processing."""
    return adapter.mm_token_type_ids(input_ids)


def cut_at_stop(response: Sequence[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """(response through its first stop token, truncated = no stop token found)."""
    stops = set(stop_ids)
    for j, tok in enumerate(response):
        if tok in stops:
            return list(response[: j + 1]), False
    return list(response), True


def _stop_set(eos_id: int | Iterable[int]) -> set[int]:
    return {int(eos_id)} if isinstance(eos_id, int) else {int(x) for x in eos_id}


def _concat_vision(
    vision: Sequence[dict[str, Any]] | None, batch: int, adapter: FamilyAdapter, prompts: list[list[int]]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Concatenate per-sample vision dicts in sample order; check pad-token counts against the grids.

    ``prompts``: the ids holding each sample's vision pads (the prompt; prompt + response for a multi-turn sample,
    whose tool images sit in its response)."""
    vision = list(vision) if vision is not None else [{} for _ in range(batch)]
    if len(vision) != batch:
        raise ValueError(f"{len(vision)} vision dicts for {batch} samples")
    parts: dict[str, list[torch.Tensor]] = {}
    image_num, video_num = [], []
    for i, v in enumerate(vision):
        v = {k: x for k, x in v.items() if k not in _NON_VISION_KEYS and x is not None}
        img_grid = v.get("image_grid_thw")
        vid_grid = v.get("video_grid_thw")
        image_num.append(0 if img_grid is None else int(img_grid.shape[0]))
        video_num.append(0 if vid_grid is None else int(vid_grid.shape[0]))
        ids = torch.as_tensor(prompts[i])
        for grid, token, name in ((img_grid, adapter.image_token_id, "image"),
                                  (vid_grid, adapter.video_token_id, "video")):
            expected = 0 if grid is None else int(adapter.tokens_per_grid(grid).sum())
            found = int((ids == token).sum())
            if expected != found:
                raise ValueError(f"sample {i}: prompt has {found} {name} pad tokens, its grids need {expected}")
        for key, value in v.items():
            parts.setdefault(key, []).append(torch.as_tensor(value))
    fields: dict[str, Any] = {"image_num": image_num, "video_num": video_num}
    extra: dict[str, torch.Tensor] = {}
    for key, values in parts.items():
        joined = torch.cat(values, dim=0)  # items (or patch rows) of all samples, in sample order
        if key in _VISION_FIELDS:
            fields[_VISION_FIELDS[key]] = joined
        else:
            # Unknown keys are per-video values (the only kind Qwen-VL processors add, e.g. second_per_grid_ts).
            if joined.shape[0] != sum(video_num):
                raise ValueError(f"{key!r}: {joined.shape[0]} values for {sum(video_num)} videos")
            extra[key] = joined
    return fields, extra


def _prepare(prompt_ids, response_ids, eos_id, response_masks=None):
    """(prompts, responses, truncated, masks). Without ``response_masks`` responses are cut after their first stop
    token; with them (multi-turn samples: 1 policy token, 0 observation token, one per response token) responses
    are taken as they are, since a trajectory holds a stop token at the end of every turn."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(response_ids)} responses")
    prompts = [list(p) for p in prompt_ids]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every sample needs at least one prompt token to score its response")
    if response_masks is None:
        stops = _stop_set(eos_id)
        cut = [cut_at_stop(r, stops) for r in response_ids]
        responses = [c[0] for c in cut]
        truncated = torch.tensor([c[1] for c in cut], dtype=torch.bool)  # [B]
        return prompts, responses, truncated, None
    if len(response_masks) != len(response_ids):
        raise ValueError(f"{len(response_masks)} response masks for {len(response_ids)} responses")
    responses = [list(r) for r in response_ids]
    masks = []
    for i, (r, m) in enumerate(zip(responses, response_masks)):
        m = [bool(x) for x in (m.tolist() if isinstance(m, torch.Tensor) else m)]
        if len(m) != len(r):
            raise ValueError(f"sample {i}: response mask of {len(m)} entries for {len(r)} response tokens")
        masks.append(m)
    return prompts, responses, torch.zeros(len(responses), dtype=torch.bool), masks


def _vision_ids(prompts: list[list[int]], responses: list[list[int]], masks) -> list[list[int]]:
    """The ids whose vision pads each sample's vision dict covers: the prompt, plus the response when it may hold
    observation images (multi-turn samples)."""
    return prompts if masks is None else [p + r for p, r in zip(prompts, responses)]


def policy_action_mask(responses: list[list[int]], masks, width: int) -> torch.Tensor:
    """[B, width] bool: the response tokens the policy generated (all of them for single-turn samples)."""
    action_mask = torch.zeros((len(responses), width), dtype=torch.bool)  # [B, A]
    for i, r in enumerate(responses):
        if masks is None:
            action_mask[i, : len(r)] = True
        else:
            action_mask[i, : len(r)] = torch.tensor(masks[i], dtype=torch.bool)
    return action_mask


def routed_rows(routed_experts: Sequence[Any] | None, lengths: Sequence[int]) -> list[torch.Tensor] | None:
    """Each sample's engine routing as an int16 [len_i, L, k] tensor over its prompt + response tokens: the
    engine's rows (it has one per token it ran, one fewer than the sample's tokens) cut or extended with -1 (no
    routing) to the sample's length. None when no sample carries routing; a sample without it is all -1."""
    if routed_experts is None or all(r is None for r in routed_experts):
        return None
    if len(routed_experts) != len(lengths):
        raise ValueError(f"{len(routed_experts)} routed-experts arrays for {len(lengths)} samples")
    shape = next(tuple(torch.as_tensor(r).shape[1:]) for r in routed_experts if r is not None)  # (L, k)
    rows = []
    for r, n in zip(routed_experts, lengths):
        out = torch.full((n, *shape), -1, dtype=torch.int16)  # [len_i, L, k]
        if r is not None:
            r = torch.as_tensor(r).to(torch.int16)[:n]
            if tuple(r.shape[1:]) != shape:
                raise ValueError(f"routed experts of shape {tuple(r.shape)} beside {shape} per token")
            out[: r.shape[0]] = r
        rows.append(out)
    return rows


def build_padded_samples(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int | Iterable[int],
    adapter: FamilyAdapter,
    vision: Sequence[dict[str, Any]] | None = None,
    response_masks: Sequence[Sequence[int]] | None = None,
    routed_experts: Sequence[Any] | None = None,
    **meta: Any,
) -> BuiltSamples:
    """Batched layout: left-padded prompts + right-padded responses, ``sequences`` [B, P + A].

    ``routed_experts``: per sample the engine's [tokens, L, k] expert choice over its prompt + response
    (``rollout.routing_replay``; :func:`routed_rows`), laid out like ``sequences`` in ``SamplesVL.routed_experts``.

    ``eos_id``: one stop token id or several. ``response_masks``: per response token, 1 for a policy token and 0 for
    an observation token (multi-turn samples; ``action_mask`` then marks the policy tokens only, and responses are
    not cut at stop tokens). ``meta``: extra SamplesVL fields passed through (prompts, labels, references,
    raw_images).
    """
    prompts, responses, truncated, masks = _prepare(prompt_ids, response_ids, eos_id, response_masks)
    batch = len(prompts)
    p_max = max(len(p) for p in prompts)
    a_max = max(len(r) for r in responses)
    sequences = torch.full((batch, p_max + a_max), pad_id, dtype=torch.long)  # [B, S]
    attention_mask = torch.zeros((batch, p_max + a_max), dtype=torch.long)  # [B, S] 1 real token, 0 padding
    for i, (p, r) in enumerate(zip(prompts, responses)):
        sequences[i, p_max - len(p) : p_max] = torch.tensor(p, dtype=torch.long)
        sequences[i, p_max : p_max + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, p_max - len(p) : p_max + len(r)] = 1
    routing = routed_rows(routed_experts, [len(p) + len(r) for p, r in zip(prompts, responses)])
    routed = None
    if routing is not None:
        routed = torch.full((batch, p_max + a_max, *routing[0].shape[1:]), -1, dtype=torch.int16)  # [B, S, L, k]
        for i, (p, rows) in enumerate(zip(prompts, routing)):
            routed[i, p_max - len(p) : p_max - len(p) + rows.shape[0]] = rows
    action_mask = policy_action_mask(responses, masks, a_max)  # [B, A]
    types = mm_token_type_ids(sequences, adapter) * attention_mask  # [B, S]; pad tokens are text
    fields, extra = _concat_vision(vision, batch, adapter, _vision_ids(prompts, responses, masks))
    samples = SamplesVL(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        num_actions=a_max,
        packed_seq_lens=None,
        response_length=torch.tensor([len(r) for r in responses], dtype=torch.long),  # [B]
        total_length=torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)], dtype=torch.long),
        mm_token_type_ids=types,
        routed_experts=routed,
        **fields,
        **meta,
    )
    return BuiltSamples(samples, truncated, extra)


def build_packed_samples(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int | Iterable[int],
    adapter: FamilyAdapter,
    vision: Sequence[dict[str, Any]] | None = None,
    response_masks: Sequence[Sequence[int]] | None = None,
    routed_experts: Sequence[Any] | None = None,
    **meta: Any,
) -> BuiltSamples:
    """Packed layout: every sample's prompt + response back to back, ``sequences`` [1, T], no padding.

    ``attention_mask`` [1, T] holds the 1-based sample index of each token. ``pad_id`` is unused (kept so both
    builders take the same arguments). ``response_masks`` (multi-turn samples): ``action_mask`` [B, A] then marks
    the policy tokens of each response (single-turn packed batches carry none: every response token is one).
    ``routed_experts``: as in :func:`build_padded_samples`, concatenated in token order ([1, T, L, k]).
    """
    del pad_id
    prompts, responses, truncated, masks = _prepare(prompt_ids, response_ids, eos_id, response_masks)
    batch = len(prompts)
    seqs = [p + r for p, r in zip(prompts, responses)]
    sequences = torch.tensor([tok for s in seqs for tok in s], dtype=torch.long)[None]  # [1, T]
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # [B]
    attention_mask = torch.repeat_interleave(torch.arange(1, batch + 1), lens)[None]  # [1, T]
    fields, extra = _concat_vision(vision, batch, adapter, _vision_ids(prompts, responses, masks))
    response_length = torch.tensor([len(r) for r in responses], dtype=torch.long)  # [B]
    routing = routed_rows(routed_experts, [len(x) for x in seqs])
    samples = SamplesVL(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=None if masks is None else policy_action_mask(responses, masks, max(len(r) for r in responses)),
        num_actions=response_length.clone(),
        packed_seq_lens=lens,
        response_length=response_length,
        total_length=lens.clone(),
        mm_token_type_ids=mm_token_type_ids(sequences, adapter),  # [1, T]
        routed_experts=None if routing is None else torch.cat(routing)[None],  # [1, T, L, k]
        **fields,
        **meta,
    )
    return BuiltSamples(samples, truncated, extra)
