"""How much autograd keeps for the backward: the activation memory a training forward holds until its backward runs.

Counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor an operation saves passes through the pack
hook. Storages are counted once however many views of them are saved, and the parameters' own storages are left
out (they exist whatever the forward keeps), so the number is what the forward adds. Tensors saved inside a
checkpointed region go through the checkpoint's own hooks instead and are not kept: what remains is what
checkpointing leaves (the blocks' inputs), which is the point of measuring it. Device-independent: it reads sizes,
not the allocator, so it runs the same on the CPU as on a GPU (where ``torch.cuda.max_memory_allocated`` adds the
allocator's own peaks: transient buffers, fragmentation).
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import torch

T = TypeVar("T")


def saved_tensor_bytes(run: Callable[[], T], exclude: Iterable[torch.Tensor] = ()) -> tuple[T, int]:
    """``run()``'s result and the bytes of the distinct storages autograd saved for the backward while it ran,
    ``exclude``'s storages (pass the model's parameters) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}  # storage address -> bytes (the saved tensors stay alive, so addresses stay unique)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(kept.values())
