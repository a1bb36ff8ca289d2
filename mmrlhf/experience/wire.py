"""A step's train items in columnar form for another process (Ray's object store, a scatter to the trainer ranks).

Why: pickling an item pickles each of its tensors on its own, ~100 us a tensor there and back; a toy step of 256
items holds ~3,800 small tensors, so each hop cost ~0.4 s, and a Ray step has two (rollout actor to rank 0, rank 0 to
the other ranks): more than the step's generation. Here every field's tensors travel as one flat tensor per
(field, key) plus the shapes, and come back as tensors of their own. Items split from an experience hold views of
its tensors, and a pickled view carries its whole storage (measured: a 1,024-sample toy step grew to a 4.9 GB
object): packing copies only each item's own values. Values, dtypes and shapes are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from mmrlhf.experience.batching import TrainItem

_DICTS = ("vision", "vision_extra", "token", "info")


@dataclass
class PackedItems:
    """``len(prompt_ids)`` items: ids as python lists of ints (cheap to pickle), each tensor field as one flat tensor
    per key with, per item, its shape (None: the item has no such key)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    flat: dict[tuple[str, str], torch.Tensor]
    shapes: dict[tuple[str, str], list[tuple[int, ...] | None]]

    def __len__(self) -> int:
        return len(self.prompt_ids)


def _one_dtype(field: str, key: str, dtypes: set[torch.dtype]) -> None:
    if len(dtypes) > 1:
        raise ValueError(f"items disagree on the dtype of {field}[{key!r}]: {sorted(map(str, dtypes))}")


def pack_items(items: Sequence[TrainItem]) -> PackedItems:
    """``items`` as one :class:`PackedItems` (new tensors: the items are left as they are)."""
    columns: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    fields = [(name, [getattr(it, name) for it in items]) for name in _DICTS]
    fields.append(("policy_mask", [None if it.policy_mask is None else {"": it.policy_mask} for it in items]))
    fields.append(("routed_experts", [None if it.routed_experts is None else {"": it.routed_experts} for it in items]))
    for name, dicts in fields:
        keys = sorted({k for d in dicts if d for k in d})
        for key in keys:
            columns[(name, key)] = [d.get(key) if d else None for d in dicts]
    flat, shapes = {}, {}
    for (name, key), tensors in columns.items():
        present = [t for t in tensors if t is not None]
        _one_dtype(name, key, {t.dtype for t in present})
        flat[(name, key)] = torch.cat([t.detach().reshape(-1) for t in present])  # a key is there: one has it
        shapes[(name, key)] = [None if t is None else tuple(t.shape) for t in tensors]
    return PackedItems([list(it.prompt_ids) for it in items], [list(it.response_ids) for it in items], flat, shapes)


def unpack_items(packed: PackedItems) -> list[TrainItem]:
    """The items of ``packed``, each tensor its own (cloned out of the flat one)."""
    n = len(packed)
    names = (*_DICTS, "policy_mask", "routed_experts")
    fields: dict[str, list[dict[str, torch.Tensor]]] = {name: [{} for _ in range(n)] for name in names}
    for (name, key), flat in packed.flat.items():
        shapes = packed.shapes[(name, key)]
        if len(shapes) != n:
            raise ValueError(f"{name}[{key!r}] holds {len(shapes)} shapes for {n} items")
        sizes = [None if shape is None else math.prod(shape) for shape in shapes]
        total = sum(size for size in sizes if size is not None)
        if total != flat.numel():
            raise ValueError(f"{name}[{key!r}]: {flat.numel()} values for shapes totalling {total}")
        offset = 0
        for i, (shape, size) in enumerate(zip(shapes, sizes)):
            if shape is not None:
                fields[name][i][key] = flat[offset: offset + size].reshape(shape).clone()
                offset += size
    return [TrainItem(packed.prompt_ids[i], packed.response_ids[i], fields["vision"][i], fields["vision_extra"][i],
                      fields["token"][i], fields["info"][i], fields["policy_mask"][i].get(""),
                      fields["routed_experts"][i].get(""))
            for i in range(n)]
