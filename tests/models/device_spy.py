"""A simulated accelerator for the device tests: CPU data behind tensors that report another device.

Why not the ``meta`` device itself: a meta tensor has no data, so nothing data-dependent (response lengths, M-RoPE
positions, the advantage code) could run behind it, and a maker could not bring its results back (``torch.tensor(...,
device="meta")`` even drops its values before any mode sees them). Here a :class:`OnDevice` tensor keeps its values
in a plain CPU tensor and reports ``device`` (``meta`` by default: the CPU can never be mistaken for it, and it
needs no runtime), and :class:`SimulatedDevice` runs every operation on the CPU data while
enforcing an accelerator's rule: an operation that mixes tensors of the simulated device with CPU tensors of one or
more elements fails with the message CUDA gives ("Expected all tensors to be on the same device"). Exceptions, as
on CUDA: 0-d CPU tensors (scalars), CPU index tensors of an indexing operation, and ``copy_`` (a cross-device
copy). ``.to(device)`` moves in and out like a real device; factory functions with ``device=`` create on it.

Tests only: every model, batch and loss runs unchanged, with real numbers, so a forgotten move shows as the error a
GPU would raise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing

aten = torch.ops.aten
# Operations that accept CPU index tensors for an accelerator tensor (the indices are moved for the caller).
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_MOVES = {aten._to_copy.default}


class OnDevice(torch.Tensor):
    """A CPU tensor (``inner``) reporting the simulated device."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, requires_grad: bool | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=device, layout=inner.layout,
            requires_grad=inner.requires_grad if requires_grad is None else requires_grad)

    def __init__(self, inner: torch.Tensor, device: torch.device, requires_grad: bool | None = None) -> None:
        self.inner = inner

    def tolist(self):  # torch refuses tolist() on subclasses; an accelerator tensor copies to the host
        return self.inner.tolist()

    def __repr__(self) -> str:
        return f"OnDevice({self.device}, {self.inner!r})"

    def __tensor_flatten__(self):
        return ["inner"], self.device

    @staticmethod
    def __tensor_unflatten__(inner_tensors, device, outer_size, outer_stride):
        return OnDevice(inner_tensors["inner"], device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a simulated-device tensor used outside its SimulatedDevice context")


class SimulatedDevice(TorchDispatchMode):
    """Context manager: inside it, ``device`` behaves like an accelerator whose memory is the CPU's."""

    def __init__(self, device: str | torch.device = "meta") -> None:
        super().__init__()
        self.device = torch.device(device)
        self._constructors = _Constructors(self)

    def __enter__(self):
        self._constructors.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._constructors.__exit__(*exc)

    # ---- placing ---------------------------------------------------------------------------------------------
    def wrap(self, t: torch.Tensor) -> OnDevice:
        return OnDevice(t, self.device)

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """Put ``module``'s parameters and buffers on the simulated device (what ``module.to(device)`` does)."""
        return module._apply(lambda t: t if isinstance(t, OnDevice) else self.wrap(t.detach()))

    # ---- dispatch --------------------------------------------------------------------------------------------
    def _is_sim(self, device: Any) -> bool:
        return device is not None and torch.device(device).type == self.device.type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        flat = pytree.tree_leaves((args, kwargs))
        on_sim = any(isinstance(x, OnDevice) for x in flat)
        unwrap = lambda tree: pytree.tree_map_only(OnDevice, lambda x: x.inner, tree)  # noqa: E731
        if func in _MOVES:
            src = args[0]
            target = kwargs.get("device")
            if target is not None:
                kwargs["device"] = torch.device("cpu")
            out = func(*unwrap(args), **unwrap(kwargs))
            if target is None:
                return self.wrap(out) if isinstance(src, OnDevice) else out
            return self.wrap(out) if self._is_sim(target) else out
        if func is aten.copy_.default:  # cross-device copies are allowed
            func(*unwrap(args), **unwrap(kwargs))
            return args[0]
        if on_sim and func not in _INDEX_OPS:
            cpu = [x for x in flat if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice) and x.dim() > 0]
            if cpu:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, {self.device} and cpu! ({func}, CPU shapes "
                                   f"{[tuple(x.shape) for x in cpu]})")
        create = self._is_sim(kwargs.get("device"))
        if create:
            kwargs["device"] = torch.device("cpu")
        out = func(*unwrap(args), **unwrap(kwargs))
        if not (on_sim or create):
            return out
        wrapped = pytree.tree_map_only(torch.Tensor, self.wrap, out)
        return return_and_correct_aliasing(func, args, kwargs, wrapped)


class _Constructors(TorchFunctionMode):
    """``torch.tensor`` / ``torch.as_tensor`` with ``device=`` the simulated device: built on the CPU, then moved
    (torch builds a meta tensor without its values before any dispatch mode could see them)."""

    def __init__(self, sim: SimulatedDevice) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and self.sim._is_sim(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
            return func(*args, **kwargs).to(self.sim.device)
        return func(*args, **kwargs)


def tensor_devices(obj: Any) -> set[str]:
    """Device types of every tensor inside ``obj`` (tensors, dataclasses, NamedTuples, lists, tuples, dicts)."""
    import dataclasses

    found: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.add(x.device.type)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return found
