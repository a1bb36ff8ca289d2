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

``model.linear_attention_kernel`` picks: ``auto`` is ``fla`` only where it can run (CUDA, the package importable)
AND it has run there: ``mmrlhf doctor --gpu`` compared it with the torch rule on this machine (its ``fla`` rows:
the rule's output, final states and gradients, the initial states' included, and a tiny Qwen3.5's grouped forward
and gradients, bf16) and recorded the pass (:mod:`mmrlhf.proofs`, keyed by the GPU's name and the torch, fla and
triton versions). Else ``auto`` is ``torch``. Why not fla wherever it imports: the suite runs on CPUs, where fla
cannot run (its tests there use a fake that calls the torch rule), so an unchecked fla is a path that never ran; the
torch path is exact and merely slower. The choice and its reason are logged once per device and process
(:func:`resolve_delta_kernel`); naming ``fla`` runs it without a proof (the user's choice). A kernel is registered by
name in :data:`VARLEN_RULES` as a factory returning a :data:`VarlenRule`; the tests register a fake one to run the
varlen path on the CPU. ``mmrlhf doctor`` reports the resolved path.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any, Callable

import torch

from mmrlhf import proofs
from mmrlhf.registry import Registry

logger = logging.getLogger(__name__)

# (q [1, T, H, dk], k, v [1, T, H, dv], g [1, T, H] log decay, beta [1, T, H], cu_seqlens [N + 1] long,
#  initial_state [N, H, dk, dv] | None, output_final_state) -> (out [1, T, H, dv], final [N, H, dk, dv] | None);
# q and k not yet L2-normalised (the kernel normalises them, as the layer asks)
VarlenRule = Callable[..., tuple[torch.Tensor, Any]]
VARLEN_RULES: Registry[Callable[[], VarlenRule]] = Registry("linear-attention kernel")
TORCH = "torch"  # the gather path: no varlen rule
FLA_DEVICE_TYPES = ("cuda",)  # where fla's (Triton) kernels run
FLA_CHECK = "linear_attention_fla"  # the doctor's check whose proof lets ``auto`` pick fla (mmrlhf.proofs)


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


def fla_fingerprint(device: torch.device | str) -> dict[str, str] | None:
    """What a proof of fla on ``device`` is valid for (:func:`mmrlhf.proofs.fingerprint`): the GPU's name, torch,
    flash-linear-attention and triton (its kernels are Triton programs) versions; None where fla cannot be proven."""
    return proofs.fingerprint(device, {"fla": ("flash-linear-attention", "fla-core"), "triton": ("triton",)})


def resolve_delta_kernel(setting: str, device: torch.device | str) -> str:
    """``model.linear_attention_kernel`` -> ``"torch"`` or a registered varlen kernel's name, for layers computing on
    ``device``. ``auto``: ``fla`` where it can run and the doctor proved it on this machine, else ``torch``
    (:func:`auto_kernel`). Naming ``fla`` where it cannot run is an error naming the key."""
    check_setting(setting)
    if setting == "auto":
        return auto_kernel(str(torch.device(device)))[0]
    if setting == TORCH:
        return TORCH
    if setting == "fla" and torch.device(device).type not in FLA_DEVICE_TYPES:
        raise ValueError(f"model.linear_attention_kernel=fla runs on CUDA only, not on {device}: use auto or torch")
    return setting


@functools.lru_cache(maxsize=None)
def auto_kernel(device: str) -> tuple[str, str]:
    """What ``auto`` picks on ``device`` and why; decided (and logged, in one line) once per device and process:
    the layers ask at every forward, and the answer cannot change while the process runs."""
    name, why = TORCH, ""
    if torch.device(device).type not in FLA_DEVICE_TYPES:
        why = "not CUDA"
    elif not fla_available():
        why = "flash-linear-attention not installed"
    else:
        fp = fla_fingerprint(device)
        proof = proofs.find(FLA_CHECK, fp)
        if proof is not None:
            name, why = "fla", f"proven on this machine by mmrlhf doctor on {proof.get('date', '?')}"
        else:
            why = ("fla is installed but has not been checked on this machine (GPU, torch, fla and triton versions): "
                   "run `mmrlhf doctor --gpu --only fla` to compare it with the torch rule and use it, or set "
                   "model.linear_attention_kernel=fla")
    logger.info("model.linear_attention_kernel=auto on %s: %s (%s)", device, name, why)
    return name, why


def varlen_rule(name: str) -> VarlenRule | None:
    """The varlen rule of a resolved kernel name (None for ``torch``, the gather path)."""
    return None if name == TORCH else VARLEN_RULES.get(name)()


def describe(setting: str, device: torch.device | str) -> str:
    """One line for the doctor: the path a run with ``setting`` takes on ``device``, and why."""
    name = resolve_delta_kernel(setting, device)
    if name != TORCH:
        why = f"; {auto_kernel(str(torch.device(device)))[1]}" if setting == "auto" else ""
        return f"{name} (variable-length: sequence boundaries and initial states, no padding rows{why})"
    why = auto_kernel(str(torch.device(device)))[1] if setting == "auto" else f"model.linear_attention_kernel={setting}"
    return f"torch (each sequence gathered into a padded batch; {why})"
