"""A float32 Gated DeltaNet core for vLLM's CPU platform, so a Qwen3.5 engine can run in float32 there.

vLLM's CPU kernels for the linear-attention layers (the short causal convolution, the gating and the chunked /
recurrent delta rule) take bfloat16 only ("CPU GDN attention requires BF16"). A float32 engine is what makes the
engine-vs-trainer comparison exact on a CPU (bfloat16 on both sides differs by rounding, not by bugs), so this
module supplies the same computation in plain torch for float32 layers and leaves every other dtype to vLLM's
kernels. It changes nothing on an accelerator (``forward_cpu`` only runs on the CPU platform).

The math, per sequence and value head (keys shared by ``num_v_heads / num_k_heads`` value heads):

    x_t  = silu(conv1d(qkv)_t)             causal, kernel W, state = the last W-1 inputs
    q, k = l2norm(q), l2norm(k);  q /= sqrt(d_k)
    g_t  = -exp(A_log) * softplus(a_t + dt_bias);  beta_t = sigmoid(b_t)
    S_t  = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T      S: [d_k, d_v]
    o_t  = q_t^T S_t

Both states live in vLLM's per-request cache slots, so decode steps continue prefills exactly as the engine's own
kernels do. Sequences of one step are batched over time (a loop of ``max length`` steps, shorter ones masked).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

_INSTALLED = False


def install_float32_gdn() -> bool:
    """Route float32 Gated DeltaNet layers of CPU engines through :func:`gdn_core` (idempotent; call before the
    engine runs). False where the installed vLLM has no such layer (nothing to patch)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    except ImportError:
        return False
    layer_cls = _gdn_layer_class(gdn)
    if layer_cls is None:
        return False
    original = layer_cls.forward_cpu

    @functools.wraps(original)
    def forward_cpu(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != torch.float32 or getattr(self, "gqa_interleaved_layout", False):
            return original(self, hidden_states)
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)  # [T, 2 * key_dim + 2 * value_dim] (this rank's part)
        ba, _ = self.in_proj_ba(hidden_states)  # [T, 2 * num_v_heads]
        qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
        z = z.reshape(z.size(0), -1, self.head_v_dim)  # [T, Hv, Dv]
        b, a = ba.chunk(2, dim=-1)
        out = torch.zeros(hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim,
                          dtype=hidden_states.dtype, device=hidden_states.device)  # [T, Hv, Dv]
        gdn_core(self, mixed_qkv, b, a, out)
        return self._output_projection(out, z)

    forward_cpu.__wrapped_original__ = original  # type: ignore[attr-defined]
    layer_cls.forward_cpu = forward_cpu
    _INSTALLED = True
    return True


def _gdn_layer_class(module: Any) -> type | None:
    """The class in vLLM's module that defines ``forward_cpu`` and ``rearrange_mixed_qkv`` (the layer)."""
    for value in vars(module).values():
        if isinstance(value, type) and "forward_cpu" in vars(value) and hasattr(value, "rearrange_mixed_qkv"):
            return value
    return None


def gdn_core(layer: Any, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """Fill ``out`` [T, Hv, Dv] for this step's tokens of every sequence (decodes first, then prefills, as vLLM
    orders them). ``mixed_qkv`` [T, 2 * key_dim + value_dim] (before the convolution), ``b`` / ``a`` [T, Hv]."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if metadata is None:  # the profiling run
        return
    meta = metadata[layer.prefix]
    if meta.num_actual_tokens == 0:
        return
    if meta.spec_sequence_masks is not None:
        raise NotImplementedError("the float32 CPU Gated DeltaNet path does not support speculative decoding")
    starts = meta.non_spec_query_start_loc.tolist()  # [N + 1]
    slots = meta.non_spec_state_indices_tensor.tolist()  # [N]
    # Over every sequence of the step, decodes included (None when the step only decodes: all continue a state).
    has_initial = [True] * len(slots) if meta.has_initial_state is None else meta.has_initial_state.tolist()
    conv_states, ssm_states = _conv_states(layer), _ssm_states(layer)
    weight = _conv_weight(layer)  # [D, W]
    lengths = [e - s for s, e in zip(starts[:-1], starts[1:])]
    width, steps = weight.shape[1], max(lengths)
    n = len(lengths)

    # Padded batch of this step's inputs: x [N, L, D], with each sequence's conv history in front.
    x = mixed_qkv.new_zeros(n, width - 1 + steps, mixed_qkv.shape[-1])
    gate_a = a.new_zeros(n, steps, a.shape[-1])
    gate_b = b.new_zeros(n, steps, b.shape[-1])
    state = ssm_states.new_zeros(n, *ssm_states.shape[1:])  # [N, Hv, Dk, Dv]
    for i, (start, length, slot) in enumerate(zip(starts, lengths, slots)):
        if has_initial[i]:
            x[i, :width - 1] = conv_states[slot].to(x.dtype)
            state[i] = ssm_states[slot]
        x[i, width - 1:width - 1 + length] = mixed_qkv[start:start + length]
        gate_a[i, :length] = a[start:start + length]
        gate_b[i, :length] = b[start:start + length]
    conv = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1).to(x.dtype), getattr(layer.conv1d, "bias", None),
                    groups=weight.shape[0]).transpose(1, 2)  # [N, L, D]
    conv = F.silu(conv)

    q, k, v = conv.split([layer.key_dim // layer.tp_size, layer.key_dim // layer.tp_size,
                          layer.value_dim // layer.tp_size], dim=-1)
    q = q.reshape(n, steps, -1, layer.head_k_dim)  # [N, L, Hk, Dk]
    k = k.reshape(n, steps, -1, layer.head_k_dim)
    v = v.reshape(n, steps, -1, layer.head_v_dim)  # [N, L, Hv, Dv]
    groups = v.shape[2] // q.shape[2]
    q, k = _l2norm(q).repeat_interleave(groups, dim=2), _l2norm(k).repeat_interleave(groups, dim=2)
    q = q * layer.head_k_dim**-0.5
    decay = -layer.A_log.float().exp() * F.softplus(gate_a.float() + layer.dt_bias.float())  # [N, L, Hv]
    beta = gate_b.float().sigmoid()

    result = torch.zeros_like(v)
    ends = torch.tensor(lengths, device=v.device)[:, None, None, None]  # [N, 1, 1, 1]
    for t in range(steps):
        live = t < ends  # sequences still running at step t
        s = state * decay[:, t, :, None, None].exp()
        memory = (s * k[:, t, :, :, None]).sum(dim=-2)  # [N, Hv, Dv]
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        result[:, t] = (s * q[:, t, :, :, None]).sum(dim=-2)
        state = torch.where(live, s, state)

    for i, (start, length, slot) in enumerate(zip(starts, lengths, slots)):
        out[start:start + length] = result[i, :length].to(out.dtype)
        end = width - 1 + length
        conv_states[slot] = x[i, end - (width - 1):end].to(conv_states.dtype)
        ssm_states[slot] = state[i].to(ssm_states.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _conv_states(layer: Any) -> Any:
    """The conv cache as a [slots, W - 1, D] view, whichever layout vLLM keeps it in."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    cache = layer.kv_cache[0]
    return cache.transpose(-1, -2) if is_conv_state_dim_first() else cache


def _ssm_states(layer: Any) -> torch.Tensor:
    """The recurrent-state cache as [slots, Hv, Dk, Dv] (this module alone reads and writes float32 states)."""
    cache = layer.kv_cache[1]
    slots, heads, first, second = cache.shape
    return cache.view(slots, heads, second, first)


def _conv_weight(layer: Any) -> torch.Tensor:
    """The plain [D, W] convolution weight (vLLM keeps an unpacked copy where its CPU kernels pack it)."""
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if weight is None:
        weight = layer.conv1d.weight
    return weight.reshape(weight.shape[0], weight.shape[-1])
