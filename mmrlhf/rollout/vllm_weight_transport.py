"""How one weight-update bucket travels from the trainer's process into vLLM's workers.

``LLM.apply_model(fn)`` runs ``fn(model)`` in every worker. With the in-process executor (one worker, this process)
``fn`` is called as it is; with tensor parallelism vLLM's multiprocess executor sends ``fn`` through its message
queue, which pickles it with plain ``pickle``. So what is sent is always ``functools.partial(load_bucket,
payload=...)``: a module-level function and a payload of picklable parts (a lambda or a closure fails there with
``PicklingError``).

Two transports of the payload, chosen by :func:`choose_transport`:

* ``inline``: the tensors themselves. In-process (TP 1, the CPU) nothing is copied: the worker loads from the
  trainer's tensors directly.
* ``cuda_ipc``: tensor parallelism on CUDA. Pickled tensors would be copied whole into shared memory for EVERY
  worker (each needs only its shard); instead each tensor travels as a CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor``: a few hundred bytes), each worker opens the trainer's
  tensor in place and its model's ``load_weights`` copies only its own shard out of it. The trainer's tensors stay
  alive until ``apply_model`` returns (it waits for every worker), which is the lifetime the handles need. The
  workers of vLLM's multiprocess executor inherit the parent's ``CUDA_VISIBLE_DEVICES``, so the handle's device
  index means the same GPU on both sides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

TRANSPORTS = ("inline", "cuda_ipc")


def choose_transport(tensor_parallel_size: int, device_type: str) -> str:
    """``cuda_ipc`` when the engine's workers are other processes on CUDA (tensor parallelism), else ``inline``."""
    return "cuda_ipc" if tensor_parallel_size > 1 and device_type == "cuda" else "inline"


@dataclass(frozen=True)
class BucketPayload:
    """One bucket as sent to the workers: names, and per tensor either the tensor itself or (``cuda_ipc``, a CUDA
    tensor) its IPC handle, ``(rebuild function, its arguments)`` as torch's reducer returns them."""

    transport: str
    names: tuple[str, ...]
    items: tuple[Any, ...]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs on the worker's side (IPC handles opened in place, nothing copied)."""
        return [(name, item if isinstance(item, torch.Tensor) else item[0](*item[1]))
                for name, item in zip(self.names, self.items)]


def pack_bucket(bucket: Sequence[tuple[str, torch.Tensor]], transport: str,
                reduce: Callable[[torch.Tensor], tuple[Callable, tuple]] | None = None) -> BucketPayload:
    """The payload of ``bucket`` for ``transport``. Under ``cuda_ipc`` a tensor that is not on CUDA (a trainer
    kept on the host) still travels inline, copied to every worker. ``reduce``: the IPC reducer (default torch's
    ``reduce_tensor``; a test passes its own, there being no CUDA here)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {transport!r}; one of {TRANSPORTS}")
    names = tuple(name for name, _ in bucket)
    tensors = [t.detach() for _, t in bucket]
    if transport == "inline":
        return BucketPayload(transport, names, tuple(tensors))
    if reduce is None:
        from torch.multiprocessing.reductions import reduce_tensor as reduce
    return BucketPayload(transport, names, tuple(reduce(t) if t.device.type == "cuda" else t for t in tensors))


def bucket_loader(payload: BucketPayload) -> functools.partial:
    """What ``apply_model`` is given: picklable with plain ``pickle`` (module-level function + payload)."""
    return functools.partial(load_bucket, payload=payload)


def load_bucket(model: Any, payload: BucketPayload) -> tuple[set[str], dict[str, str]]:
    """Runs in each worker: load the payload's tensors into the engine's ``model`` (see :func:`load_named`)."""
    return load_named(model, payload.tensors())


def load_named(model: Any, bucket: list[tuple[str, Any]]) -> tuple[set[str], dict[str, str]]:
    """Load one bucket into the engine's model.

    Tied weights (a tied checkpoint's ``lm_head.weight`` IS the input embedding in vLLM) are held back: vLLM's
    loader accepts such an alias only in the same call as its canonical weight, and a size-bounded bucket may
    separate them. The alias carries nothing new when the canonical weight is loaded in the same update, which
    the caller checks with the returned ``{alias name: canonical engine name}``. Returns the engine-side names
    loaded and those held aliases.
    """
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    ids: dict[int, str] = {}
    tied: dict[str, str] = {}  # engine name of a parameter -> the engine name it aliases
    for name, param in model.named_parameters(remove_duplicate=False):
        first = ids.setdefault(id(param), name)
        if first != name:
            tied[name] = first
    load, held = [], {}
    for name, tensor in bucket:
        mapped = [n for n, _ in mapper.apply([(name, tensor)])] if mapper is not None else [name]
        canonical = next((tied[n] for n in mapped if n in tied), None)
        if canonical is not None:
            held[name] = canonical
        else:
            load.append((name, tensor))
    return set(model.load_weights(iter(load))) if load else set(), held
