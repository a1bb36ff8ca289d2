"""Recurrent decoder layers (Gated DeltaNet linear attention) run every sample of a batch from its own first token:
the recurrent state and the short causal convolution restart at every packed boundary, and never cross padding.

Why, packed rows: an attention layer isolates the samples of a packed row through its block-diagonal mask (built by
transformers from the restarting positions), but a linear-attention layer reads no mask. Its state runs from the
first token of the row to the last, and its depthwise convolution (kernel 4) mixes the last tokens of one sample
into the first of the next. transformers (5.19, ``modeling_qwen3_5.Qwen3_5GatedDeltaNet``) hands boundaries only to
fla's CUDA ``chunk_gated_delta_rule(cu_seqlens=)``; the ``causal_conv1d_fn`` fallback and both torch delta rules
ignore them, so on the CPU (and on a GPU without those kernels) a packed row leaks one sample into the next:
measured on the tiny models, log-probs off by up to 0.013 (qwen3_5) and 0.007 (qwen3_5_moe) from the samples alone.

Why, padded rows: transformers zeroes padded hidden states before the layer, so the state and the convolution stay
zero through left padding and the FORWARD is exact (5e-7). The torch chunked delta rule, though, sums the decay of
every padded step into the cumulative decay of the chunk's real tokens (float32, magnitude ~ padding x |decay|) and
takes differences of those sums: the gradients of the decay parameters (``A_log``, ``dt_bias``) came out 3e-3 (of
their scale) away from the samples' own on the tiny qwen3_5, in float64 inputs too (the kernel computes in float32);
with the samples gathered to start at their first token, 6e-5 (float32 summation order; float64: 2e-16).

How: :func:`install` gives every such layer (found by its parts: ``in_proj_qkv``, ``conv1d``, ``A_log``,
``dt_bias``; no family names) a forward that, given the batch's :class:`Segments` under the keyword
:data:`SEGMENTS_KWARG`, gathers each sample into a right-padded batch ``[n, L, H]``, runs the layer's OWN forward
on it (each state and convolution starts from zero, exactly as alone; right padding cannot reach earlier tokens of
a causal layer) and scatters the real tokens back (zeros elsewhere, which is what the layer gives at padding).
Gradients flow through the gather and the scatter; the kernels are whatever transformers picked (fla / causal-conv1d
on CUDA where installed, the torch fallbacks elsewhere), never bypassed. Cost: ``n * L_max`` token rows instead of
``T`` for a packed row (linear in length; similar lengths waste little), the same rows for a padded batch. With a
variable-length kernel (``model.linear_attention_kernel``, :mod:`mmrlhf.models.delta_kernels`: fla's
``cu_seqlens`` on CUDA), handed over under :data:`VARLEN_KWARG`, the samples' tokens run as one row with their
boundaries instead (:func:`mmrlhf.models.gated_delta.varlen_forward`: the layer's computation with the states
threaded through), no padding rows. Without the keywords (generation, a direct model call) the layer runs as
shipped.

The keyword travels with the model's own ``**kwargs`` (model -> decoder layer -> token mixer), so a checkpointed
block recomputes with the same segments. Other modules that receive it (attention functions, the vision tower)
ignore unknown keywords.

Shared prompts (the grouped layout, :mod:`mmrlhf.models.shared_prompt`): a tree mask tells an attention layer which
tokens a response sees, but a recurrent state cannot skip the other responses of its row. So, given
:class:`TreeSegments` (a grouped batch), the layer runs each row's prompt once, from zero, keeping its convolution tail
and recurrent state at the prompt's end, then every response of the row continues from a copy of that state
(:func:`mmrlhf.models.gated_delta.continued_forward`: the layer's own computation with the two states threaded
through). Each response's tokens are computed exactly as in its own sequence, and autograd sums the responses'
gradients into the prompt once, as for the attention layers under the tree mask.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import nn

from mmrlhf.models.delta_kernels import rule_runs
from mmrlhf.models.gated_delta import MixerState, continued_forward, varlen_forward

SEGMENTS_KWARG = "mmrlhf_segments"  # not a transformers keyword: nothing else reads it
VARLEN_KWARG = "mmrlhf_varlen_rule"  # a variable-length delta rule (mmrlhf.models.delta_kernels); absent: gather
_PARTS = ("in_proj_qkv", "conv1d", "A_log", "dt_bias")


class Segments(NamedTuple):
    """Where each sample of a batch lies, as the gather of its tokens into a right-padded batch of samples."""

    index: torch.Tensor  # [n, L] long: flat position (row * S + s) of each sample's token l (clamped past its end)
    valid: torch.Tensor  # [n, L] bool: l < the sample's length
    lengths: tuple[int, ...] = ()  # n sample lengths, on the host (a varlen kernel's boundaries)


class TreeSegments(NamedTuple):
    """A grouped batch (rows of one prompt and its responses) for the recurrent layers: the prompts, the responses,
    and which row's prompt each response continues."""

    prompts: Segments  # [G, P] each row's prompt from its first token
    responses: Segments  # [B, R] each sample's response from its first token
    owner: torch.Tensor  # [B] long: the row (prompt) each response continues


def tree_segments(row_length: int, prompt_lengths: torch.Tensor, sample_row: torch.Tensor,
                  sample_start: torch.Tensor, response_length: torch.Tensor) -> TreeSegments:
    """:class:`TreeSegments` of a grouped batch of rows ``row_length`` long (the fields of
    :class:`mmrlhf.models.batch.GroupedSamples`: prompts start their rows; response i starts at column
    ``sample_start[i]`` of row ``sample_row[i]``), computed on the host."""
    prompt_lengths, rows = torch.as_tensor(prompt_lengths).long(), torch.as_tensor(sample_row).long()
    total = int(prompt_lengths.numel()) * row_length
    prompts = _gather(torch.arange(prompt_lengths.numel()) * row_length, prompt_lengths, total)
    responses = _gather(rows * row_length + torch.as_tensor(sample_start).long(),
                        torch.as_tensor(response_length).long(), total)
    return TreeSegments(prompts, responses, rows)


def segments(lengths: torch.Tensor) -> Segments:
    """:class:`Segments` of one packed row of samples of ``lengths`` [n] (their sum = the row length T), computed
    where the lengths are (the host: no device sync per layer)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)  # [n]
    return _gather(lengths.cumsum(0) - lengths, lengths, int(lengths.sum()))


def padded_segments(attention_mask: torch.Tensor) -> Segments | None:
    """:class:`Segments` of a padded batch (``attention_mask`` [B, S] 0/1, one contiguous run of ones per row: left
    padding, the sample, right padding), or None where a row's ones are not contiguous."""
    mask = attention_mask.bool()  # [B, S]
    b, s = mask.shape
    lengths = mask.sum(1)  # [B]
    first = mask.int().argmax(1)  # [B] first real token (0 for an empty row)
    steps = torch.arange(s)[None]  # [1, S]
    if not torch.equal(mask, (steps >= first[:, None]) & (steps < (first + lengths)[:, None])):
        return None
    return _gather(first + torch.arange(b) * s, lengths, b * s)


def _gather(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> Segments:
    width = int(lengths.max()) if lengths.numel() else 0
    steps = torch.arange(width)[None]  # [1, L]
    valid = steps < lengths[:, None]  # [n, L]
    index = (starts[:, None] + steps).clamp(max=max(total - 1, 0))  # [n, L]
    return Segments(index, valid, tuple(int(n) for n in lengths.tolist()))


def recurrent_layers(model: nn.Module) -> list[nn.Module]:
    """The linear-attention token mixers of ``model`` (modules holding all of ``in_proj_qkv``, ``conv1d``, ``A_log``,
    ``dt_bias``)."""
    return [m for m in model.modules() if all(hasattr(m, p) for p in _PARTS)]


def declares_recurrent(model: nn.Module) -> bool:
    """Whether ``model``'s config declares decoder layers other than full attention (or says nothing of its layer
    types): a hybrid family's checkpoint whose layers are all full attention (an ablation) has no recurrent layer to
    find, and that is not an error."""
    types = getattr(model.config.get_text_config(), "layer_types", None)
    return not types or any(kind != "full_attention" for kind in types)


def installed(layer: nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _segmented_forward


def install(model: nn.Module) -> int:
    """Give every recurrent layer of ``model`` the boundary-aware forward (idempotent); returns how many it has.
    A partial, not a closure: a deep copy of the model gets a forward bound to the copied layer."""
    layers = recurrent_layers(model)
    for layer in layers:
        if not installed(layer):
            layer.forward = functools.partial(_segmented_forward, layer)
    return len(layers)


def layer_masks(model: nn.Module, mask: Any) -> Any:
    """The decoder's ``attention_mask`` for a prepared ``mask`` (a FlexAttention block mask): ``mask`` itself for a
    model without recurrent layers, else transformers' per-layer-type mapping, the attention layers' types getting
    ``mask`` and the recurrent layers' None (transformers derives their padding mask from a 2-D mask and fails on a
    block mask, ``'BlockMask' object has no attribute 'ndim'``; a packed row has no padding, and the segments carry
    its boundaries)."""
    recurrent = {getattr(m, "layer_type", None) for m in recurrent_layers(model)}
    if not recurrent:
        return mask
    types = getattr(model.config.get_text_config(), "layer_types", None)
    if not types or None in recurrent:
        raise ValueError("recurrent layers without a per-layer type: cannot route a block mask past them")
    return {t: None if t in recurrent else mask for t in types}


def _segmented_forward(layer: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer's class forward, per sample when ``kwargs`` carry :data:`SEGMENTS_KWARG`: ``hidden_states``
    [B, S, H] -> [B, S, H'], zero where no sample lies (as the layer gives at padding)."""
    seg: Segments | TreeSegments | None = kwargs.pop(SEGMENTS_KWARG, None)
    rule = kwargs.pop(VARLEN_KWARG, None)
    forward = type(layer).forward
    if seg is None:
        return forward(layer, hidden_states, *args, **kwargs)
    if args or kwargs.get("cache_params") is not None:
        raise ValueError("sample segments with a cache: a scored batch is run whole, never continued")
    kwargs.pop("attention_mask", None)  # the padding: outside the gathered samples, or zeroed below
    if rule is not None and not rule_runs(rule, _compute_dtype(layer, hidden_states)):
        rule = None  # e.g. fla in a float32 forward: the gather path
    if isinstance(seg, TreeSegments):
        return _tree_forward(layer, hidden_states, seg, rule)
    if rule is not None:
        return _varlen_samples(layer, hidden_states, seg, rule)
    b, s, _ = hidden_states.shape
    rows = hidden_states.reshape(b * s, -1)[seg.index]  # [n, L, H] each sample from its own first token
    rows = rows * seg.valid[..., None].to(rows.dtype)  # the tail past a sample's end: zeros, never read
    out = forward(layer, rows, **kwargs)  # [n, L, H']
    flat = out.new_zeros(b * s, out.shape[-1]).index_put((seg.index[seg.valid],), out[seg.valid])  # [B * S, H']
    return flat.reshape(b, s, -1)


def _compute_dtype(layer: nn.Module, hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype the layer's projections compute in: autocast's where it is on, else the weights' (FSDP2 has cast
    them to its compute dtype by the time the forward runs)."""
    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return layer.in_proj_qkv.weight.dtype


def _tree_forward(layer: nn.Module, hidden_states: torch.Tensor, tree: TreeSegments, rule: Any = None
                  ) -> torch.Tensor:
    """A grouped batch ``hidden_states`` [G, L, H] -> [G, L, H']: each prompt once, each response continuing from
    its prompt's state (zero where no token lies); through the varlen ``rule`` where given, else gathered."""
    g, s, _ = hidden_states.shape
    flat_in = hidden_states.reshape(g * s, -1)
    p, r = tree.prompts, tree.responses
    if rule is not None:
        out_p, state = varlen_forward(layer, flat_in[p.index[p.valid]][None], p.lengths, rule, keep_state=True)
        start = MixerState(state.conv[tree.owner], state.recurrent[tree.owner])  # [B, ...] each response's prompt
        out_r, _ = varlen_forward(layer, flat_in[r.index[r.valid]][None], r.lengths, rule, start)
        out_p, out_r = out_p[0], out_r[0]  # [T_p, H'], [T_r, H'] in sequence order
    else:
        prompts = flat_in[p.index] * p.valid[..., None].to(hidden_states.dtype)  # [G, P, H]
        out_p, state = continued_forward(layer, prompts, p.valid, keep_state=True)  # [G, P, H'], per row
        start = MixerState(state.conv[tree.owner], state.recurrent[tree.owner])  # [B, ...] each response's prompt
        responses = flat_in[r.index] * r.valid[..., None].to(hidden_states.dtype)  # [B, R, H]
        out_r, _ = continued_forward(layer, responses, r.valid, start)  # [B, R, H']
        out_p, out_r = out_p[p.valid], out_r[r.valid]
    flat = out_p.new_zeros(g * s, out_p.shape[-1])
    flat = flat.index_put((p.index[p.valid],), out_p).index_put((r.index[r.valid],), out_r)
    return flat.reshape(g, s, -1)


def _varlen_samples(layer: nn.Module, hidden_states: torch.Tensor, seg: Segments, rule: Any) -> torch.Tensor:
    """A packed row or padded batch [B, S, H] -> [B, S, H'] through the varlen ``rule``: the samples' tokens in one
    row, their boundaries to the kernel (zero where no sample lies)."""
    b, s, _ = hidden_states.shape
    where = seg.index[seg.valid]  # [T] flat positions of the samples' tokens, sample after sample
    out, _ = varlen_forward(layer, hidden_states.reshape(b * s, -1)[where][None], seg.lengths, rule)  # [1, T, H']
    flat = out.new_zeros(b * s, out.shape[-1]).index_put((where,), out[0])
    return flat.reshape(b, s, -1)
