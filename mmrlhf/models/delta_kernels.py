"""Which kernel runs the Gated DeltaNet layers over a batch of many sequences: the choice, in one place.

Two paths, both exact (tests/models/test_models_delta_kernels.py):

- ``torch``, the CPU's path and the reference: each sequence gathered into a right-padded batch ``[n, L_max]`` and run
  through the layer's own functions (transformers' torch fallbacks, or fla / causal-conv1d where transformers wired
  them for the layer), from its first token or continuing its shared prompt's state
  (:mod:`mmrlhf.models.linear_attention`). Costs ``n x L_max`` token rows in these layers.
- a variable-length kernel (``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` with ``cu_seqlens`` and one
  initial state per sequence): every sequence's tokens flattened into one row, boundaries given to the kernel, no
  padding rows at all (:func:`mmrlhf.models.gated_delta.varlen_forward`). CUDA, bf16 / fp16 compute: fla has no
  float32 kernel, so a float32 forward (``model.dtype: float32``) takes the torch path.

``model.linear_attention_kernel`` picks: ``auto`` is ``fla`` where it can run (CUDA and the package importable),
else ``torch``. A kernel is registered by name in :data:`VARLEN_RULES` as a factory returning a :data:`VarlenRule`;
the tests register a fake one to run the varlen path on the CPU. ``mmrlhf doctor`` reports the resolved path.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch

from mmrlhf.registry import Registry

# (q [1, T, H, dk], k, v [1, T, H, dv], g [1, T, H] log decay, beta [1, T, H], cu_seqlens [N + 1] long,
#  initial_state [N, H, dk, dv] | None, output_final_state) -> (out [1, T, H, dv], final [N, H, dk, dv] | None);
# q and k not yet L2-normalised (the kernel normalises them, as the layer asks)
VarlenRule = Callable[..., tuple[torch.Tensor, Any]]
VARLEN_RULES: Registry[Callable[[], VarlenRule]] = Registry("linear-attention kernel")
TORCH = "torch"  # the gather path: no varlen rule
FLA_DEVICE_TYPES = ("cuda",)  # where fla's (Triton) kernels run


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """Whether flash-linear-attention is importable (without importing it: it pulls triton in)."""
    return importlib.util.find_spec("fla") is not None


@VARLEN_RULES.register("fla")
def fla_rule() -> VarlenRule:
    """flash-linear-attention's chunked gated delta rule over sequence boundaries."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def rule(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                      use_qk_l2norm_in_kernel=True)

    rule.dtypes = (torch.bfloat16, torch.float16)  # type: ignore[attr-defined]  # fla has no float32 kernel
    return rule


def rule_runs(rule: Any, dtype: torch.dtype) -> bool:
    """Whether ``rule`` computes in ``dtype`` (a rule may list its ``dtypes``; one that does not takes any)."""
    return dtype in getattr(rule, "dtypes", (dtype,))


def check_setting(setting: str) -> None:
    """Refuse, before any forward, a ``model.linear_attention_kernel`` that names no kernel, or ``fla`` without the
    package (the device is checked where the layers compute: :func:`resolve_delta_kernel`)."""
    if setting in ("auto", TORCH):
        return
    if setting not in VARLEN_RULES:
        raise ValueError(f"model.linear_attention_kernel={setting!r}: choose auto, {TORCH} or one of "
                         f"{', '.join(VARLEN_RULES.names())}")
    if setting == "fla" and not fla_available():
        raise ValueError("model.linear_attention_kernel=fla, but flash-linear-attention is not installed "
                         "(pip install flash-linear-attention): use auto or torch")


def resolve_delta_kernel(setting: str, device: torch.device | str) -> str:
    """``model.linear_attention_kernel`` -> ``"torch"`` or a registered varlen kernel's name, for layers computing on
    ``device``. ``auto``: ``fla`` on CUDA where the package is installed, else ``torch``. Naming ``fla`` where it
    cannot run is an error naming the key."""
    check_setting(setting)
    fla_device = torch.device(device).type in FLA_DEVICE_TYPES
    if setting in ("auto", TORCH):
        return "fla" if setting == "auto" and fla_device and fla_available() else TORCH
    if setting == "fla" and not fla_device:
        raise ValueError(f"model.linear_attention_kernel=fla runs on CUDA only, not on {device}: use auto or torch")
    return setting


def varlen_rule(name: str) -> VarlenRule | None:
    """The varlen rule of a resolved kernel name (None for ``torch``, the gather path)."""
    return None if name == TORCH else VARLEN_RULES.get(name)()


def describe(setting: str, device: torch.device | str) -> str:
    """One line for the doctor: the path a run with ``setting`` takes on ``device``, and why."""
    name = resolve_delta_kernel(setting, device)
    if name != TORCH:
        return f"{name} (variable-length: sequence boundaries and initial states, no padding rows)"
    why = ("flash-linear-attention not installed" if not fla_available() else
           "not CUDA" if torch.device(device).type not in FLA_DEVICE_TYPES else
           f"model.linear_attention_kernel={setting}")
    return f"torch (each sequence gathered into a padded batch; {why})"
