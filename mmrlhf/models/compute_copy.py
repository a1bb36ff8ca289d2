"""The compute copy: low-precision copies of a model's matrix weights, cast once per optimiser step and used by
every micro-batch of it, with the float32 master weights and a float32 main gradient kept as they are.

Why: under ``torch.autocast`` (float32 master parameters, bf16 compute: :mod:`mmrlhf.models.precision`) every
forward casts each Linear weight to bf16 again (autocast's cast cache lives only inside one ``autocast`` region),
and so does each recomputation under gradient checkpointing. At Qwen2.5-VL-7B shape on an H200 that was ~70 ms per
micro-batch whatever its tokens: the casts of ~15 GiB of float32 weights. The weights change only at the optimiser
step, so one cast per step is enough.

How: :meth:`ComputeCopy.active` swaps, for its duration, each selected parameter of its modules for a leaf tensor
in the compute dtype holding the master's value (re-cast only when the master changed since the last cast: the
tensor's in-place version counter moves at every optimiser step and checkpoint load, not for a frozen weight).
Autocast sees a weight already in its dtype and casts only the activations, so the forward and backward compute
exactly what they computed before: the copy's values are autocast's cast, and each micro-batch's weight gradient,
produced in the compute dtype as before, is added in float32 into the MASTER's ``.grad`` by a hook on the copy
(what autocast's cast did in its backward). Clipping, the optimiser, checkpoints and the weight sync read the
masters and never see a copy. Gradient checkpointing's recomputation runs inside the region, so it uses the
copies too.

What is copied: the weight and bias of every ``nn.Linear`` (the decoder's projections, the lm_head, LoRA's base
layers and adapters, the vision blocks) stored in another floating dtype than the compute one. Parameters read
outside a matrix product stay as they are (embeddings and norms: autocast would not cast them either, and the
residual stream stays float32), and so do weights that autocast casts inside other operators (convolutions, the
experts of a mixture-of-experts block stored as one 3-D tensor).

Memory: the copies live from the first micro-batch of an update to :meth:`ComputeCopy.release` (the trainer
releases them after each update), the size of what autocast saved for the backward without gradient checkpointing
(its cast copies), and that much more with checkpointing (autocast then saves none): the memory plan counts it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


@dataclass
class _Slot:
    module: nn.Module
    name: str  # "weight" | "bias"
    master: nn.Parameter
    copy: torch.Tensor | None = None  # the compute-dtype leaf, made at the first activation
    version: int = -1  # master._version when the copy was last cast


def _accumulate_into(master: nn.Parameter):
    """A post-accumulate-grad hook for a copy: its gradient, added in float32 into the master's (as autocast's
    cast did in its backward), then dropped from the copy."""

    def hook(copy: torch.Tensor) -> None:
        grad = copy.grad
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)
        copy.grad = None

    return hook


class ComputeCopy:
    """The compute-dtype copies of ``modules``' Linear weights (see the module docstring).

    ``dtype``: the compute dtype (``Precision.autocast_dtype``). A model with nothing to copy (everything already
    in ``dtype``) makes an empty, inert copy."""

    def __init__(self, modules: nn.Module | list[nn.Module], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.slots: list[_Slot] = []
        seen: set[int] = set()
        for root in modules if isinstance(modules, list) else [modules]:
            for module in root.modules():
                if not isinstance(module, nn.Linear) or id(module) in seen:
                    continue
                seen.add(id(module))
                for name in ("weight", "bias"):
                    p = module._parameters.get(name)
                    if p is not None and p.is_floating_point() and p.dtype != dtype:
                        self.slots.append(_Slot(module, name, p))
        self._active = False

    @property
    def numel(self) -> int:
        return sum(s.master.numel() for s in self.slots)

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold while they exist."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @torch.no_grad()
    def _refresh(self) -> int:
        """Cast the masters that changed since their copy was made; returns how many were cast."""
        cast = 0
        for s in self.slots:
            if s.copy is None:
                s.copy = torch.empty_like(s.master, dtype=self.dtype).requires_grad_(s.master.requires_grad)
                if s.master.requires_grad:
                    s.copy.register_post_accumulate_grad_hook(_accumulate_into(s.master))
                s.version = -1
            if s.version != s.master._version:
                s.copy.copy_(s.master)
                s.version = s.master._version
                cast += 1
        return cast

    @contextlib.contextmanager
    def active(self) -> Iterator[int]:
        """Within: the modules compute with the copies (forwards, backwards, recomputation). Yields the number of
        tensors cast on entry. Re-entering while active is refused (a swap inside a swap would lose the masters)."""
        if self._active:
            raise RuntimeError("ComputeCopy.active() is already entered")
        cast = self._refresh()
        self._active = True
        for s in self.slots:
            s.module._parameters[s.name] = s.copy  # a plain leaf, not a Parameter: optimisers never see it
        try:
            yield cast
        finally:
            for s in self.slots:
                s.module._parameters[s.name] = s.master
            self._active = False
            for s in self.slots:
                if s.copy is not None and s.copy.grad is not None:  # a backward whose hook did not run (it raised)
                    s.copy.grad = None

    def stale(self, trained_only: bool = True) -> None:
        """Mark the copies (of the trained masters only, by default) for a re-cast at the next activation, as if
        an optimiser step had moved their masters: for a master changed where its version counter does not see
        it (through ``.data``), and for benchmarks that time the cast an optimiser step causes."""
        for s in self.slots:
            if s.master.requires_grad or not trained_only:
                s.version = -1

    def release(self) -> None:
        """Free the copies (made again, cast from the masters, at the next activation)."""
        if self._active:
            raise RuntimeError("ComputeCopy.release() inside active()")
        for s in self.slots:
            s.copy, s.version = None, -1
