"""LoRA (peft) adapters on the policy (its language model, and with ``model.lora.vision`` its vision tower and / or
merger): apply, merge for the engine, save and reload.

Why peft is injected in place rather than used as the outer module: :class:`~mmrlhf.models.actor.ActorVL` runs
``model.base_model`` and reads ``lm_head.weight`` itself. ``get_peft_model`` replaces the matching Linear layers of
the Hugging Face model by LoRA layers *inside* that model, so ``actor.model`` stays the transformers model and every
forward path of the actor (padded, packed, shared prompt) goes through the adapters unchanged. The ``PeftModel``
that owns the adapters is kept beside the actor (not registered as a submodule, so no parameter is listed twice) and
gives peft's own adapter format (``save_pretrained`` / ``PeftModel.from_pretrained``) and ``disable_adapter``.

Which layers: in the language model, the ``nn.Linear`` modules whose name ends with one of
``model.lora.target_modules``; on the vision side (the family adapter's
:meth:`~mmrlhf.models.adapters.FamilyAdapter.vision_parts`), every ``nn.Linear`` of the tower's blocks (``vision:
tower``), of its merger modules (``merger``), or both. Why every Linear rather than names: the families name their
vision layers differently (``qkv`` / ``fc1`` in Qwen2-VL, ``gate_proj`` in Qwen2.5-VL, ``linear_fc1`` in Qwen3-VL,
the last colliding with nothing but the first ones with language-model names), and "adapt the tower" means all of
it. The output head is refused: the actor multiplies by ``lm_head.weight`` directly, so an adapter there would be
silently bypassed. Routed experts (the MoE families' ``mlp.experts``) are 3-D parameters, not Linear layers: LoRA
leaves them frozen (a target that only an expert MLP would have matched is an error that says so); a shared expert
and the linear-attention projections (``in_proj_qkv``, ``in_proj_z``, ``out_proj``) are Linear layers like any. Module names are resolved here to exact paths, so peft never guesses.

For the engine, :func:`merged_weights` yields ``W + (alpha / r) B A`` of each adapted layer under the base weight's
transformers name (what every engine loads), one layer at a time, plus any other trainable parameter.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from mmrlhf.config.model import LoraConfig

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"  # peft's adapter name; one adapter per policy
_PEFT_ATTR = "_lora_peft_model"  # where the PeftModel lives on the actor (outside the module tree)


def lora_model(owner: Any) -> Any | None:
    """The ``PeftModel`` owning the adapters of ``owner`` (the actor or its transformers model), or None when it has
    no LoRA."""
    return getattr(owner, "__dict__", {}).get(_PEFT_ATTR)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter gathered to its full value; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def vision_lora_modules(model: nn.Module, adapter: Any, vision: str) -> list[str]:
    """Exact paths of the vision-side Linear layers ``model.lora.vision`` adapts (``none`` / ``tower`` /
    ``merger`` / ``both``); raises when the chosen part holds no Linear layer."""
    if vision == "none":
        return []
    tower, mergers = adapter.vision_parts(model)
    merger_ids = {id(m) for part in mergers for m in part.modules()}
    tower_ids = {id(m) for m in tower.modules()}
    want = {"tower": {"tower"}, "merger": {"merger"}, "both": {"tower", "merger"}}[vision]
    found: dict[str, list[str]] = {"tower": [], "merger": []}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) in tower_ids:
            found["merger" if id(module) in merger_ids else "tower"].append(name)
    for part in sorted(want):
        if not found[part]:
            raise ValueError(f"model.lora.vision={vision}: the {adapter.family} vision {part} has no Linear layer")
    return sorted(n for part in want for n in found[part])


def resolve_target_modules(model: nn.Module, adapter: Any, cfg: LoraConfig) -> list[str]:
    """Exact module paths (in ``model``'s naming) that get adapters: ``cfg.target_modules`` in the language model,
    plus the vision side ``cfg.vision`` selects; raises naming the key when a target matches nothing or hits the
    output head."""
    tower, _ = adapter.vision_parts(model)
    vision_ids = {id(m) for m in tower.modules()}
    head = model.get_output_embeddings()
    found: dict[str, list[str]] = {t: [] for t in cfg.target_modules}
    vision_only: dict[str, int] = {t: 0 for t in cfg.target_modules}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        for target in cfg.target_modules:
            if name != target and not name.endswith("." + target):
                continue
            if module is head:
                raise ValueError(f"model.lora.target_modules: {target!r} matches the output head {name!r}, which the "
                                 "actor reads as a plain weight (an adapter there would be bypassed); remove it")
            if id(module) in vision_ids:
                vision_only[target] += 1
                continue
            found[target].append(name)
    experts = getattr(adapter, "routed_experts", False)
    for target, names in found.items():
        if not names:
            where = (f" (it matches {vision_only[target]} vision-tower layers: the vision side is adapted with "
                     "model.lora.vision=tower | merger | both)") if vision_only[target] else ""
            if experts and not where:
                where = (" (this model's MLPs are routed experts, stored as 3-D weights, not Linear layers: LoRA "
                         "does not adapt experts; drop it from the list, or train the experts fully with "
                         "model.lora.rank=0)")
            raise ValueError(f"model.lora.target_modules: {target!r} matches no Linear layer of the language "
                             f"model{where}")
    language = {n for names in found.values() for n in names}
    return sorted(language | set(vision_lora_modules(model, adapter, cfg.vision)))


def planned_targets(path: str | Path, adapter: Any, cfg: LoraConfig, *, trust_remote_code: bool = False) -> list[str]:
    """:func:`resolve_target_modules` on an empty copy of the model at ``path``: its modules built from its
    ``config.json`` on the meta device (no weight read, no memory taken), so that every refusal of the targets (a
    name that matches nothing, the output head, a routed-expert MLP, an empty vision part) comes before a model of
    any size loads. The names are those of the loaded model: the same class from the same config."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        empty = AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)
    return resolve_target_modules(empty, adapter, cfg)


def apply_lora(actor: Any, cfg: LoraConfig, *, adapter_path: str | Path | None = None) -> Any:
    """Put adapters into ``actor.model`` in place and freeze everything else; returns the ``PeftModel``.

    ``adapter_path`` (default ``cfg.adapter``): a saved peft adapter to start from; its rank, alpha and layers must
    be the configured ones. Without it the adapters are fresh (B = 0: the policy starts as the base model).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    if cfg.rank <= 0:
        raise ValueError("apply_lora: model.lora.rank is 0 (LoRA off); set model.lora.rank > 0")
    if lora_model(actor) is not None:
        raise ValueError("apply_lora: the actor already has LoRA adapters")
    targets = resolve_target_modules(actor.model, actor.adapter, cfg)
    path = str(adapter_path or cfg.adapter or "")
    if path:
        check_saved_adapter(path, cfg, targets, [n for n, m in actor.model.named_modules()
                                                 if isinstance(m, nn.Linear)])
        peft_model = PeftModel.from_pretrained(actor.model, path, adapter_name=ADAPTER_NAME, is_trainable=True)
    else:
        peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                  target_modules=targets, bias="none")
        peft_model = get_peft_model(actor.model, peft_cfg, adapter_name=ADAPTER_NAME)
    if peft_model.base_model.model is not actor.model:
        raise RuntimeError("peft did not adapt the actor's model in place")
    actor.__dict__[_PEFT_ATTR] = peft_model
    actor.model.__dict__[_PEFT_ATTR] = peft_model  # the trainer's sync and checkpoint see only the HF model
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in actor.model.parameters())
    logger.info("LoRA r=%d on %d layers%s: %d trainable parameters (%.2f%% of %d), everything else frozen",
                cfg.rank, len(targets), f" from {path}" if path else "", trainable, 100 * trainable / total, total)
    return peft_model


def check_saved_adapter(path: str | Path, cfg: LoraConfig, targets: list[str],
                        linear_names: list[str] | None = None) -> None:
    """A saved adapter must have the configured rank, alpha and layers (it is loaded as it was saved).

    ``linear_names``: the model's Linear module paths. peft saves the layer list as given when it is short and, from
    20 layers on, as the fewest name suffixes that select exactly those layers of the model (any real model's list
    is that long); either form is resolved against these names, as peft resolves it when it loads, before the
    comparison (without them, a saved list must equal ``targets``)."""
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model.lora.adapter: {path} holds no peft adapter (no adapter_config.json)")
    saved = json.loads(config_file.read_text())
    if saved.get("r") != cfg.rank or float(saved.get("lora_alpha", 0)) != float(cfg.alpha):
        raise ValueError(f"model.lora.adapter {path} has r={saved.get('r')}, alpha={saved.get('lora_alpha')}; the "
                         f"config says model.lora.rank={cfg.rank}, model.lora.alpha={cfg.alpha}: make them agree")
    saved_targets = saved.get("target_modules")
    if isinstance(saved_targets, list) and linear_names is not None:
        saved_targets = [n for n in linear_names if any(n == t or n.endswith("." + t) for t in saved_targets)]
    elif isinstance(saved_targets, str) and linear_names is not None:  # peft's regular-expression form
        saved_targets = [n for n in linear_names if re.fullmatch(saved_targets, n)]
    if isinstance(saved_targets, list) and sorted(saved_targets) != sorted(targets):
        extra = sorted(set(saved_targets) ^ set(targets))[:4]
        raise ValueError(f"model.lora.adapter {path} adapts other layers than model.lora.target_modules / "
                         f"vision select (differing: {extra}): make them agree")


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(module path, peft LoRA layer)`` of every adapted layer of ``model``."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def _plain_name(name: str) -> str:
    """A parameter name inside a LoRA layer -> the name it has in the plain transformers model."""
    return name.replace(".base_layer.", ".")


def merged_weights(model: nn.Module, *, only_trainable: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(transformers name, tensor)`` of the adapted policy, one merged layer at a time (lazy: at most one merged
    weight exists beyond the model).

    Adapted layers: ``W + scaling * B @ A`` [out, in] under ``<layer>.weight``, computed in float32 and kept in it
    when W is stored lower (``model.lora.base_dtype``: a bf16 base plus a small update would round the update
    away before the engine sees it), else cast to W's dtype. ``only_trainable``: besides those, only parameters that train (the engine already holds the frozen
    base); False: the full merged model (every parameter under its plain name), as a checkpoint needs.
    """
    layers = dict(lora_layers(model))
    for name, layer in layers.items():
        base = layer.get_base_layer()
        w = _full(base.weight)  # [out, in]
        a = _full(layer.lora_A[ADAPTER_NAME].weight).float()  # [r, in]
        b = _full(layer.lora_B[ADAPTER_NAME].weight).float()  # [out, r]
        with torch.no_grad():  # per layer, never around the yield (it would leak into the consumer)
            merged = torch.addmm(w.float(), b, a, alpha=layer.scaling[ADAPTER_NAME])  # [out, in], one fused pass
        yield f"{name}.weight", merged.to(torch.promote_types(w.dtype, torch.float32))
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if owner in layers and name.endswith(".base_layer.weight"):
            continue  # sent merged above
        if p.requires_grad or not only_trainable:
            yield _plain_name(name), _full(p).detach()


def adapter_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainable adapter tensors (A and B of every layer): what an adapter-only sync moves."""
    return [(n, p.detach()) for n, p in model.named_parameters() if ".lora_" in n]


def save_adapter(owner: Any, folder: str | Path, *, write: bool = True) -> Path:
    """peft's adapter format (``adapter_config.json`` + ``adapter_model.safetensors``) of ``owner`` (the actor or
    its transformers model) into ``folder``. Adapters sharded by FSDP2 are gathered first: every rank must call this
    (one collective per adapter tensor, in the same order); ``write`` False gathers without writing (the ranks that
    do not write)."""
    peft_model = lora_model(owner)
    if peft_model is None:
        raise ValueError("save_adapter: the actor has no LoRA adapters")
    folder = Path(folder)
    state = {name: _full(t.detach()).cpu() for name, t in peft_model.state_dict().items() if ".lora_" in name}
    if write:
        peft_model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
    return folder


def save_lora_checkpoint(model: nn.Module, folder: str | Path, *, write: bool = True) -> bool:
    """The checkpoint hook (``model``: the actor's transformers model): for a LoRA policy, ``model/`` gets the
    MERGED model (transformers format, loadable by any engine) and ``adapter/`` the peft adapter (what a resume
    loads). Returns False (nothing written) without LoRA, so the caller saves the plain model itself. Sharded by
    FSDP2: every rank calls it (the gathers are collectives, tensor by tensor), ``write`` on one of them."""
    if lora_model(model) is None:
        return False
    folder = Path(folder)
    state = {}
    for name, t in merged_weights(model, only_trainable=False):
        if write:
            state[name] = t.detach().cpu().contiguous()
    if write:
        model.save_pretrained(str(folder / "model"), state_dict=state, safe_serialization=True)
    save_adapter(model, folder / "adapter", write=write)
    return True


def resume_adapter_path(policy_path: str | None) -> Path | None:
    """The adapter a resumed LoRA run loads: ``<checkpoint>/adapter`` beside the checkpoint's ``model/``."""
    if not policy_path:
        return None
    folder = Path(policy_path).parent / "adapter"
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"resuming a LoRA run (model.lora.rank > 0) needs the checkpoint's adapter at "
                                f"{folder}, which is missing: was the checkpoint written without LoRA?")
    return folder


class AdapterOffScorer:
    """The reference policy of a LoRA run without a second copy: the actor's own module with its adapters off.

    Exact because only the adapters train (the base weights are frozen): with adapters disabled each LoRA layer
    returns its base layer's output. Called like an :class:`~mmrlhf.models.actor.ActorVL`."""

    def __init__(self, actor: Any):
        if lora_model(actor) is None:
            raise ValueError("AdapterOffScorer needs an actor with LoRA adapters")
        self.actor = actor

    @property
    def excluded_token_ids(self) -> tuple[int, ...]:
        return self.actor.excluded_token_ids

    @excluded_token_ids.setter
    def excluded_token_ids(self, ids: Any) -> None:
        if tuple(sorted({int(i) for i in ids})) != self.actor.excluded_token_ids:
            raise ValueError("the reference shares the actor's module: it must exclude the same tokens")

    def __call__(self, samples: Any, **kwargs: Any) -> Any:
        with lora_model(self.actor).disable_adapter():
            return self.actor(samples, **kwargs)

    forward = __call__
