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

:func:`varlen_forward` is the same computation over many sequences flattened into one row, for a kernel that takes
sequence boundaries and one initial state per sequence (:mod:`mmrlhf.models.delta_kernels`): no padding rows.

That a continued response equals the same tokens in the sample's own sequence is tested per family and prompt
kind (tests/models/test_models_shared_prompt.py), the variable-length path against the gather path in
tests/models/test_models_delta_kernels.py.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

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
    mixed, z, beta_in, a = _project(layer, hidden)  # [B, C, T], [B, T, Hv, dv], [B, T, Hv] x 2
    before = mixed.new_zeros(b, mixed.shape[1], k - 1) if start is None else start.conv.to(mixed.dtype)
    history = torch.cat([before, mixed], dim=-1)  # [B, C, K - 1 + T]
    conv = _conv(layer, history)[:, :, k - 1:]  # [B, C, T]
    query, key, value = _heads(layer, conv)
    beta, g = _gates(layer, beta_in, a, valid[..., None])  # no write and no decay past the end
    core, final = _module_function(layer, "torch_chunk_gated_delta_rule")(
        query, key, value, g=g, beta=beta, initial_state=None if start is None else start.recurrent,
        output_final_state=keep_state, use_qk_l2norm_in_kernel=True)  # [B, T, Hv, dv], [B, Hv, dk, dv]
    out = _finish(layer, core, z)
    if not keep_state:
        return out, None
    ends = valid.sum(1)  # [B] each row's length; its last K - 1 columns sit at ends .. ends + K - 2 of history
    cols = (ends[:, None] + torch.arange(k - 1, device=ends.device)[None])  # [B, K - 1]
    tail = history.gather(2, cols[:, None, :].expand(-1, history.shape[1], -1))  # [B, C, K - 1]
    return out, MixerState(tail, final)


def varlen_forward(layer: nn.Module, hidden: torch.Tensor, lengths: tuple[int, ...], rule: Any,
                   start: MixerState | None = None, keep_state: bool = False) -> tuple[torch.Tensor, MixerState | None]:
    """``layer``'s output for N sequences of ``lengths`` flattened into one row ``hidden`` [1, T, H], each from zero
    or continuing ``start`` (per sequence), through a variable-length delta rule ``rule``
    (:data:`mmrlhf.models.delta_kernels.VarlenRule`: boundaries and initial states given to the kernel, no padding).

    The convolution runs on one extended row in which every sequence is preceded by its K - 1 history columns (the
    start's tail, or zeros): each token's window then lies within its own sequence and its history, and the layer's
    own causal convolution function serves every sequence at once."""
    t, k, n = hidden.shape[1], layer.conv_kernel_size, len(lengths)
    dev = hidden.device
    mixed, z, beta_in, a = _project(layer, hidden)  # [1, C, T], [1, T, Hv, dv], [1, T, Hv] x 2
    lens = torch.tensor(lengths, dtype=torch.long, device=dev)  # [N]
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0))  # [N + 1]
    seq = torch.repeat_interleave(torch.arange(n, device=dev), lens)  # [T] each token's sequence
    pos = torch.arange(t, device=dev) + (seq + 1) * (k - 1)  # [T] each token's column in the extended row
    taps = torch.arange(k - 1, device=dev)  # [K - 1]
    history_cols = (cu[:-1] + torch.arange(n, device=dev) * (k - 1))[:, None] + taps[None]  # [N, K - 1]
    channels = mixed.shape[1]
    ext = mixed.new_zeros(channels, t + n * (k - 1)).index_copy(1, pos, mixed[0])  # [C, T + N(K - 1)]
    if start is not None:
        ext = ext.index_copy(1, history_cols.reshape(-1),
                             start.conv.to(mixed.dtype).permute(1, 0, 2).reshape(channels, -1))
    conv = _conv(layer, ext[None])[:, :, pos]  # [1, C, T]
    query, key, value = _heads(layer, conv)
    beta, g = _gates(layer, beta_in, a, None)
    core, final = rule(query, key, value, g, beta, cu, None if start is None else start.recurrent,
                       keep_state)  # [1, T, Hv, dv], [N, Hv, dk, dv]
    out = _finish(layer, core, z)
    if not keep_state:
        return out, None
    last = (cu[1:] - 1 + (torch.arange(n, device=dev) + 1) * (k - 1))[:, None] - (k - 2) + taps[None]  # [N, K - 1]
    tail = ext[:, last.reshape(-1)].reshape(channels, n, k - 1).permute(1, 0, 2)  # [N, C, K - 1]
    return out, MixerState(tail, final)


def _project(layer: nn.Module, hidden: torch.Tensor):
    """The layer's input projections of ``hidden`` [B, T, H]: mixed q/k/v [B, C, T] (pre-convolution), the gate z
    [B, T, Hv, dv], and the write / decay inputs [B, T, Hv] each."""
    b, t, _ = hidden.shape
    mixed = layer.in_proj_qkv(hidden).transpose(1, 2)
    z = layer.in_proj_z(hidden).reshape(b, t, -1, layer.head_v_dim)
    return mixed, z, layer.in_proj_b(hidden), layer.in_proj_a(hidden)


def _conv(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's causal depthwise convolution (with its activation) of ``x`` [B, C, S] -> [B, C, S]."""
    return _module_function(layer, "causal_conv1d_fn")(x, layer.conv1d.weight.squeeze(1), layer.conv1d.bias,
                                                       activation=layer.activation)


def _heads(layer: nn.Module, conv: torch.Tensor):
    """Convolved [B, C, T] -> query, key [B, T, Hv, dk] (key heads repeated to the value heads) and value
    [B, T, Hv, dv]."""
    b, _, t = conv.shape
    query, key, value = torch.split(conv.transpose(1, 2), [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(b, t, -1, layer.head_k_dim)
    key = key.reshape(b, t, -1, layer.head_k_dim)
    value = value.reshape(b, t, -1, layer.head_v_dim)
    repeat = layer.num_v_heads // layer.num_k_heads
    if repeat > 1:
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
    return query, key, value


def _gates(layer: nn.Module, beta_in: torch.Tensor, a: torch.Tensor, keep: torch.Tensor | None):
    """Write strength beta and log decay g [B, T, Hv] (float32 decay, as the layer computes it); zero where
    ``keep`` [B, T, 1] is false."""
    beta = beta_in.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    if keep is None:
        return beta, g
    return torch.where(keep, beta, 0.0), torch.where(keep, g, 0.0)


def _finish(layer: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated norm and output projection of the delta rule's ``core`` [B, T, Hv, dv] -> [B, T, H]."""
    b, t = core.shape[:2]
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(b, t, -1))
