"""Exact parameter counts of a Qwen-VL model from its config, without allocating it.

The model is built on torch's ``meta`` device (shapes only, no storage), so counting an 8 B model takes a fraction of
a second and no memory. What trains follows the trainer's own rules, applied to that model:

* ``trainer.freeze_vision_tower`` / ``trainer.freeze_merger``: the rule of ``mmrlhf.trainer.optim.freeze_vision``
  (the tower's parameters, its mergers excepted, and the mergers), through the family adapter's ``vision_parts``;
* LoRA (``model.lora.rank > 0``): every base weight is frozen and only the adapters train; the adapted layers are
  the ones :func:`mmrlhf.models.lora.resolve_target_modules` picks for the actor (the same function), each adding
  ``rank x (in_features + out_features)`` parameters (peft's A [r, in] and B [out, r], no bias);
* tied embeddings are counted once (``model.parameters()`` yields a shared tensor once).

Besides counts, the dimensions the activation formula needs (:class:`DecoderDims`, :class:`VisionDims`) are read
from the same model, so nothing here knows a model family by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DecoderDims:
    """The language model's sizes (a Qwen2-style decoder: RMSNorms, GQA attention, SwiGLU MLP)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3)
    # routed experts (a MoE decoder): the layers whose MLP is sparse, experts per layer, experts per token, an
    # expert's intermediate size, and a shared expert's (Qwen3.5-MoE; 0 without)
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    # linear-attention (Gated DeltaNet) layers of a hybrid decoder (Qwen3.5): how many, their key / value heads and
    # head sizes and the causal convolution's kernel; the other layers are attention layers (with an output gate:
    # q_proj also produces a per-channel gate)
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    attn_output_gate: bool = False

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache (all but the linear-attention ones)."""
        return self.layers - self.linear_layers

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's sizes, read from its modules (whatever the family calls them)."""

    depth: int  # transformer blocks of the tower
    width: int  # a block's input / output features
    block_linear_features: int  # sum of in + out features over one block's Linear layers
    merger_linear_features: int  # the same over every merger (deepstack ones included), per MERGED token
    merge: int  # patches per merged token (spatial_merge_size ** 2)
    patch_pixels: int  # image pixels per merged token ((patch_size x spatial_merge_size) ** 2)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements) of one actor under one freeze / LoRA setting."""

    total: int  # every base parameter once (tied embeddings once), adapters excluded
    language: int  # embeddings, decoder layers, final norm, lm_head (once if tied)
    lm_head: int  # the output head's own weight (0 when tied to the embeddings)
    vision_tower: int  # the tower, mergers excluded
    merger: int  # the mergers (Qwen3-VL's deepstack mergers included)
    trainable: int  # what the optimiser steps: base parameters that train, plus the adapters
    trainable_without_lora: int  # what the freeze flags alone leave trainable (the critic's rule: it has no LoRA)
    frozen: int  # base parameters that do not train
    lora: int  # adapter parameters (0 without LoRA)
    decoder_layer: int  # one decoder layer (the largest FSDP unit outside the root)
    decoder_layer_trainable: int
    root: int  # parameters outside the decoder layers: the FSDP root unit (embeddings, head, norm, vision side)
    root_trainable: int
    largest_trainable_tensor: int  # elements of the largest tensor a weight sync sends (a bucket holds at least it)
    linear_weights: int  # weights of the decoder layers' Linear layers (what autocast copies for the backward)
    # routed experts' weights (3-D tensors outside any Linear: autocast casts them at every forward, and the
    # compute copy, which holds Linear weights, does not hold them)
    expert_weights: int
    tower_linear_weights: int  # the same in the vision tower's blocks
    merger_linear_weights: int  # the same in the mergers
    # elements of the Linear layers whose parameters all stay frozen (a head tied to the embeddings excluded): what
    # model.lora.base_dtype stores in bf16
    frozen_linear: int
    lm_head_trains: bool  # the output head gets a gradient (the tied embedding counts as the head)
    tower_on_grad_path: bool  # the backward runs through the vision tower (it, or adapters in it, train)
    merger_on_grad_path: bool  # the backward runs through the mergers


@dataclass(frozen=True)
class ModelFacts:
    """What the memory plan reads from a model config: dimensions and counts under the run's settings."""

    name: str  # the model class (and the shape name when planned from one)
    decoder: DecoderDims
    vision: VisionDims
    counts: ParamCounts
    tied: bool


def meta_model(hf_config: Any) -> nn.Module:
    """The ``...ForConditionalGeneration`` model of ``hf_config`` on the meta device (no storage)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(hf_config)


def _numel(params: Any) -> int:
    return sum(p.numel() for p in params)


def _linear_features(module: nn.Module) -> int:
    return sum(m.in_features + m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def _linear_weights(modules: list[nn.Module]) -> int:
    return sum(m.weight.numel() for part in modules for m in part.modules() if isinstance(m, nn.Linear))


def _frozen_linear(model: nn.Module, trains: dict[int, bool], embed: nn.Parameter) -> int:
    """Elements of the Linear layers none of whose parameters trains (each once), a head tied to ``embed`` excluded
    (the rule of :func:`mmrlhf.models.precision.store_frozen_linears`)."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if not isinstance(m, nn.Linear) or m.weight is embed:
            continue
        params = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        if any(trains[id(p)] for p in m.parameters(recurse=False)):
            continue
        seen.update(id(p) for p in params)
        total += _numel(params)
    return total


def _expert_params(layer: nn.Module) -> list[nn.Parameter]:
    """A decoder layer's routed experts: the 3-D parameters ([experts, out, in], outside any Linear) of its modules
    that count experts (a router's weight is 2-D; a convolution's 3-D weight belongs to no such module)."""
    return [p for m in layer.modules() if isinstance(getattr(m, "num_experts", None), int)
            for p in m.parameters(recurse=False) if p.dim() == 3]


def _decoder_dims(model: nn.Module, layers: list[nn.Module]) -> DecoderDims:
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    names = {name.rsplit(".", 1)[-1] for layer in layers for name, _ in layer.named_modules()}
    moe_layers = sum(bool(_expert_params(layer)) for layer in layers)
    linear = sum(1 for kind in (getattr(text, "layer_types", None) or []) if kind == "linear_attention")
    return DecoderDims(hidden=int(text.hidden_size), intermediate=int(text.intermediate_size),
                       layers=int(text.num_hidden_layers), heads=heads,
                       kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
                       vocab=int(model.get_output_embeddings().weight.shape[0]),
                       qk_norm="q_norm" in names and "k_norm" in names, moe_layers=moe_layers,
                       experts=int(getattr(text, "num_experts", 0) or 0) if moe_layers else 0,
                       top_k=int(getattr(text, "num_experts_per_tok", 0) or 0) if moe_layers else 0,
                       moe_intermediate=int(getattr(text, "moe_intermediate_size", 0) or 0) if moe_layers else 0,
                       shared_intermediate=int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
                       if moe_layers and "shared_expert" in names else 0,
                       linear_layers=linear,
                       linear_k_heads=int(getattr(text, "linear_num_key_heads", 0) or 0) if linear else 0,
                       linear_v_heads=int(getattr(text, "linear_num_value_heads", 0) or 0) if linear else 0,
                       linear_k_dim=int(getattr(text, "linear_key_head_dim", 0) or 0) if linear else 0,
                       linear_v_dim=int(getattr(text, "linear_value_head_dim", 0) or 0) if linear else 0,
                       conv_kernel=int(getattr(text, "linear_conv_kernel_dim", 0) or 0) if linear else 0,
                       attn_output_gate=any(m.out_features == 2 * heads * head_dim for layer in layers
                                            for name, m in layer.named_modules() if name.endswith("q_proj")))


def _vision_dims(adapter: Any, blocks: list[nn.Module], mergers: list[nn.Module]) -> VisionDims:
    first = blocks[0]
    widths = [m.in_features for m in first.modules() if isinstance(m, nn.Linear)]
    return VisionDims(depth=len(blocks), width=widths[0], block_linear_features=_linear_features(first),
                      merger_linear_features=sum(_linear_features(m) for m in mergers),
                      merge=adapter.merge_factor, patch_pixels=(adapter.patch_size * adapter.spatial_merge_size) ** 2)


def model_facts(hf_config: Any, *, freeze_vision_tower: bool, freeze_merger: bool, lora: Any = None,
                name: str = "") -> ModelFacts:
    """Dimensions and parameter counts of ``hf_config``'s model under the trainer's freeze / LoRA rules.

    ``lora``: a ``model.lora`` section (``LoraConfig``) or None; rank 0 means no LoRA."""
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.models.sharding import block_modules

    model = meta_model(hf_config)
    adapter = get_adapter(model.config)
    tower, mergers = adapter.vision_parts(model)
    in_tower = {id(p) for p in tower.parameters()}
    in_merger = {id(p) for m in mergers for p in m.parameters()}
    tower_modules = {id(m) for m in tower.modules()}
    blocks = block_modules(model)
    layers = [b for b in blocks if id(b) not in tower_modules]
    vision_blocks = [b for b in blocks if id(b) in tower_modules]
    params = list(model.parameters())  # shared (tied) tensors once
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    tied = head is embed

    use_lora = lora is not None and lora.rank > 0
    frozen_by_flags: dict[int, bool] = {}
    for p in params:  # the rule of trainer.optim.freeze_vision
        if id(p) in in_merger:
            frozen_by_flags[id(p)] = freeze_merger
        elif id(p) in in_tower:
            frozen_by_flags[id(p)] = freeze_vision_tower
        else:
            frozen_by_flags[id(p)] = False
    trains = {k: not (use_lora or frozen) for k, frozen in frozen_by_flags.items()}  # LoRA: no base weight trains
    adapters, adapted = 0, []
    if use_lora:
        from mmrlhf.models.lora import resolve_target_modules

        adapted = resolve_target_modules(model, adapter, lora)
        adapters = sum(lora.rank * (m.in_features + m.out_features) for m in map(model.get_submodule, adapted))
    adapted_in_tower = any(id(model.get_submodule(n)) in tower_modules for n in adapted)
    merger_modules = {id(m) for part in mergers for m in part.modules()}
    adapted_in_merger = any(id(model.get_submodule(n)) in merger_modules for n in adapted)

    layer_params = [p for b in layers for p in b.parameters()]
    in_layers = {id(p) for p in layer_params}
    root = [p for p in params if id(p) not in in_layers]
    largest_layer = max(layers, key=lambda b: _numel(b.parameters()))
    trainable_tensors = [p.numel() for p in params if trains[id(p)]]
    if use_lora:  # the merged sync sends each adapted layer's whole W + (alpha / r) B A
        trainable_tensors = [model.get_submodule(n).weight.numel() for n in adapted]
    tower_grad = (not use_lora and not freeze_vision_tower) or adapted_in_tower
    counts = ParamCounts(
        total=_numel(params),
        language=_numel(p for p in params if id(p) not in in_tower),
        lm_head=0 if tied else head.numel(),
        vision_tower=_numel(p for p in params if id(p) in in_tower and id(p) not in in_merger),
        merger=_numel(p for p in params if id(p) in in_merger),
        trainable=_numel(p for p in params if trains[id(p)]) + adapters,
        trainable_without_lora=_numel(p for p in params if not frozen_by_flags[id(p)]),
        frozen=_numel(p for p in params if not trains[id(p)]),
        lora=adapters,
        decoder_layer=_numel(largest_layer.parameters()),
        decoder_layer_trainable=_numel(p for p in largest_layer.parameters() if trains[id(p)]),
        root=_numel(root),
        root_trainable=_numel(p for p in root if trains[id(p)]),
        largest_trainable_tensor=max(trainable_tensors, default=0),
        linear_weights=_linear_weights(layers),
        expert_weights=_numel(p for b in layers for p in _expert_params(b)),
        tower_linear_weights=_linear_weights(vision_blocks),
        merger_linear_weights=_linear_weights(mergers),
        frozen_linear=_frozen_linear(model, trains, embed),
        lm_head_trains=trains[id(head)],
        tower_on_grad_path=tower_grad,
        merger_on_grad_path=tower_grad or adapted_in_merger or (not use_lora and not freeze_merger),
    )
    return ModelFacts(name=name or type(model).__name__, decoder=_decoder_dims(model, layers),
                      vision=_vision_dims(adapter, vision_blocks, mergers), counts=counts, tied=tied)
