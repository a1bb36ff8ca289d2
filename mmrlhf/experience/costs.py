"""What each sample costs a forward (:class:`~mmrlhf.parallel.micro_batches.SampleCost`), read from the pieces the
builders lay out: prompt and response ids, and the vision dict's grids (patch rows = the product of each
``grid_thw``, before the spatial merge). The planner then splits micro-batches by these numbers alone.

Grouped layout: ``SampleCost.group`` must say which samples the builder puts in one row (equal prompt ids AND equal
prompt pixels, :func:`mmrlhf.experience.grouped.group_by_prompt`), or the planned cost would not be the one laid
out. Comparing every sample's pixels would read the whole step's vision tensors once more, so the candidates are the
caller's group keys (the rollout's prompt groups: one record's samples share its prompt by construction; members
whose prompt ids differ are split off), and only one representative per candidate is compared with the other
candidates of equal prompt ids (the same image asked twice in a step, as the toy tasks do, is one row). Equal
prompt ids are common (one question over images of one size), so the representatives are first told apart by a
fingerprint of ~1,000 sampled values per tensor; only equal fingerprints are compared in full.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import torch

from mmrlhf.experience.batching import TrainItem, group_keys
from mmrlhf.experience.grouped import split_vision, vision_equal
from mmrlhf.parallel.micro_batches import Layout, SampleCost

_GRIDS = ("image_grid_thw", "video_grid_thw")


def forward_layout(*, packing: bool, shared_prompt: bool, max_row_tokens: int | None) -> Layout:
    """The layout the forwards run (the shared prompt wins over packing, as in ``collate``)."""
    if shared_prompt:
        return Layout("grouped", max_row_tokens)
    return Layout("packed" if packing else "padded")


def patch_rows(vision: Mapping[str, Any]) -> int:
    """Vision-tower patch rows of one vision dict: the sum over its images and videos of ``t * h * w``."""
    total = 0
    for key in _GRIDS:
        grid = vision.get(key)
        if grid is not None:
            total += int(torch.as_tensor(grid).reshape(-1, 3).prod(dim=-1).sum())
    return total


def _fingerprint(vision: Mapping[str, Any], samples: int = 1024) -> int:
    """A hash of the keys, shapes and ~``samples`` evenly spaced values of each tensor: different fingerprints mean
    different tensors; equal ones are checked in full."""
    parts = []
    for key in sorted(k for k, v in vision.items() if v is not None):
        t = torch.as_tensor(vision[key])
        flat = t.reshape(-1)
        parts.append((key, tuple(t.shape), str(t.dtype),
                      tuple(flat[:: max(1, flat.numel() // samples)].tolist())))
    return hash(tuple(parts))


def sample_costs(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                 vision: Sequence[Mapping[str, Any]], *, adapter: Any, grouped: bool,
                 keys: Sequence[Hashable] | None = None, multi_turn: bool = False) -> list[SampleCost]:
    """The cost of every sample. ``keys``: per sample, its prompt group (the rollout's group id; None: the prompt
    ids), the candidates for the grouped layout's rows (module docstring). ``multi_turn``: responses hold
    observation images, whose patch rows are the response's (the tail of the vision dict)."""
    n = len(prompt_ids)
    if not (len(response_ids) == len(vision) == n) or (keys is not None and len(keys) != n):
        raise ValueError(f"sample_costs: {n} prompts, {len(response_ids)} responses, {len(vision)} vision dicts"
                         + ("" if keys is None else f", {len(keys)} group keys"))
    prompt_vision, response_patches = [], []
    for i, v in enumerate(vision):
        if multi_turn and grouped:  # only the grouped layout tells the prompt's patches (once per row) apart
            head, tail = split_vision(dict(v), prompt_ids[i], adapter)
        else:
            head, tail = v, {}
        prompt_vision.append(head)
        response_patches.append(patch_rows(tail))
    groups = _row_groups(prompt_ids, prompt_vision, keys) if grouped else [None] * n
    return [SampleCost(len(p), len(r), patch_rows(pv), rp, g)
            for p, r, pv, rp, g in zip(prompt_ids, response_ids, prompt_vision, response_patches, groups)]


def _row_groups(prompt_ids: Sequence[Sequence[int]], prompt_vision: Sequence[Mapping[str, Any]],
                keys: Sequence[Hashable] | None) -> list[int]:
    """Per sample, the index of the grouped-layout row group it joins."""
    candidates: dict[tuple[Hashable, tuple[int, ...]], list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        ids = tuple(ids)
        candidates.setdefault((None if keys is None else keys[i], ids), []).append(i)
    groups = [0] * len(prompt_ids)
    heads: dict[tuple, list[tuple[int, int]]] = {}  # (prompt ids, fingerprint) -> (representative, group index)
    count = 0
    for (_, ids), members in candidates.items():
        rep = members[0]
        known = heads.setdefault((ids, _fingerprint(prompt_vision[rep])), [])
        index = next((g for r, g in known if vision_equal(prompt_vision[r], prompt_vision[rep])), None)
        if index is None:
            index, count = count, count + 1
            known.append((rep, index))
        for i in members:
            groups[i] = index
    return groups


def item_costs(items: Sequence[TrainItem], *, adapter: Any, grouped: bool) -> list[SampleCost]:
    """:func:`sample_costs` of training items (their prompt groups from :func:`group_keys`)."""
    multi = [it.policy_mask is not None for it in items]
    return sample_costs([it.prompt_ids for it in items], [it.response_ids for it in items],
                        [it.vision for it in items], adapter=adapter, grouped=grouped,
                        keys=group_keys(items), multi_turn=bool(items) and all(multi))
