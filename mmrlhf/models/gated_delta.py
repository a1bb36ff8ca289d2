"""A Gated DeltaNet token mixer's forward from a given state, with its state at each sample's end: what lets a group's
responses continue from their shared prompt (the grouped layout for hybrid models, :mod:`mmrlhf.models.
linear_attention`).

Why our own forward: the transformers layer (``Qwen3_5GatedDeltaNet`` and its MoE twin, transformers 5.19) carries a
state only through its generation cache, which updates the state in place (no gradient to the prompt) and keeps one
state per batch row (no fan-out to a group's responses). The computation is the layer's own, step for step: the same
projections, the same causal convolution and delta-rule functions looked up in the layer's own module (so the
kernels transformers picked, fla / causal-conv1d where installed, the torch fallbacks elsewhere, are the ones used),
the same gated norm and output projection. Only the two states are threaded in and out:

- the convolution (kernel K, depthwise, causal) reads the K - 1 mixed q/k/v columns before a token: a continuation
  prepends the prompt's last K - 1 columns (zeros before a sample's first token, as the layer's own zero padding),
  then drops their outputs;
- the delta rule starts from the prompt's final recurrent state [heads, d_k, d_v].

Batches are right padded; a position past a sample's end (``valid`` false) gets no write and no decay (beta = 0,
g = 0), so the state at the end of the batch row IS the state at the sample's end, and the padding sends no gradient
to the decay parameters. Positions past the end give outputs nobody reads (causal: they never reach earlier tokens).
Whether this equals the layer's own forward is tested per family (tests/models/test_models_recurrent_shared.py).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class MixerState(NamedTuple):
    """What a continuation needs of the tokens before it, per sample."""

    conv: torch.Tensor  # [B, C, K - 1] the last K - 1 mixed q/k/v columns (pre-convolution), oldest first
    recurrent: torch.Tensor  # [B, heads_v, d_k, d_v] float32 delta-rule state


def _module_function(layer: nn.Module, name: str):
    """The layer's module's ``name`` (the kernel transformers wired for this family there), or a clear error."""
    fn = getattr(sys.modules[type(layer).__module__], name, None)
    if fn is None:
        raise ValueError(f"{type(layer).__name__}: its module has no {name!r}; the continued forward of recurrent "
                         "layers (shared prompts) does not know this transformers version; set "
                         "trainer.shared_prompt=false")
    return fn


def continued_forward(layer: nn.Module, hidden: torch.Tensor, valid: torch.Tensor, start: MixerState | None = None,
                      keep_state: bool = False) -> tuple[torch.Tensor, MixerState | None]:
    """``layer``'s output for right-padded ``hidden`` [B, T, H] (``valid`` [B, T] bool: a prefix of ones per row)
    continuing from ``start`` (None: from zero, as the layer starts), and with ``keep_state`` the state after each
    row's last valid token. Gradients flow into ``start`` (a shared prompt's state receives every continuation's)."""
    b, t, _ = hidden.shape
    k = layer.conv_kernel_size
    mixed = layer.in_proj_qkv(hidden).transpose(1, 2)  # [B, C, T]
    z = layer.in_proj_z(hidden).reshape(b, t, -1, layer.head_v_dim)  # [B, T, Hv, dv]
    beta_in, a = layer.in_proj_b(hidden), layer.in_proj_a(hidden)  # [B, T, Hv] each
    before = mixed.new_zeros(b, mixed.shape[1], k - 1) if start is None else start.conv.to(mixed.dtype)
    history = torch.cat([before, mixed], dim=-1)  # [B, C, K - 1 + T]
    conv = _module_function(layer, "causal_conv1d_fn")(history, layer.conv1d.weight.squeeze(1), layer.conv1d.bias,
                                                       activation=layer.activation)[:, :, k - 1:]  # [B, C, T]
    query, key, value = torch.split(conv.transpose(1, 2), [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(b, t, -1, layer.head_k_dim)  # [B, T, Hk, dk]
    key = key.reshape(b, t, -1, layer.head_k_dim)
    value = value.reshape(b, t, -1, layer.head_v_dim)  # [B, T, Hv, dv]
    keep = valid[..., None]  # [B, T, 1]
    beta = torch.where(keep, beta_in.sigmoid(), 0.0)  # no write past the end
    g = torch.where(keep, -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias), 0.0)  # no decay
    repeat = layer.num_v_heads // layer.num_k_heads
    if repeat > 1:
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
    core, final = _module_function(layer, "torch_chunk_gated_delta_rule")(
        query, key, value, g=g, beta=beta, initial_state=None if start is None else start.recurrent,
        output_final_state=keep_state, use_qk_l2norm_in_kernel=True)  # [B, T, Hv, dv], [B, Hv, dk, dv]
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    out = layer.out_proj(core.reshape(b, t, -1))  # [B, T, H]
    if not keep_state:
        return out, None
    ends = valid.sum(1)  # [B] each row's length; its last K - 1 columns sit at ends .. ends + K - 2 of history
    cols = (ends[:, None] + torch.arange(k - 1, device=ends.device)[None])  # [B, K - 1]
    tail = history.gather(2, cols[:, None, :].expand(-1, history.shape[1], -1))  # [B, C, K - 1]
    return out, MixerState(tail, final)
