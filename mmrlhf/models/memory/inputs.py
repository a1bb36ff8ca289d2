"""The one place the memory plan reads a run's config: ``MMRLHFConfig`` -> (:class:`ModelFacts`, :class:`PlanInputs`).

The keys that change a micro-batch's activations (``trainer.gradient_checkpointing``,
``trainer.max_tokens_per_micro_batch``, ``trainer.compute_copy``) are read here, and only here (:func:`checkpointing`,
:func:`token_budget`, :func:`compute_copy`);
the fixes the plan suggests name their keys (:func:`fix_keys`).
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

from mmrlhf.models.memory.activations import INT64, MicroBatch
from mmrlhf.models.memory.counts import ModelFacts, model_facts
from mmrlhf.models.memory.plan import GIB, PlanInputs
from mmrlhf.models.ray_placement import rollout_actor_models

DEFAULT_GPU_GIB = 80.0  # the plan's GPU when none is visible and none is given
DEFAULT_RANKS = 8  # torchrun world size planned when the config does not say (one node)
DEFAULT_GPUS_PER_NODE = 8  # GPUs of one node unless --gpus-per-node says


class PlanError(ValueError):
    """The plan cannot be computed; the message names the key (or option) to set."""


def checkpointing(config: Any) -> bool:
    """Activation checkpointing of the decoder layers (and of the vision blocks when they train):
    ``trainer.gradient_checkpointing``."""
    return bool(config.trainer.gradient_checkpointing)


def compute_copy(config: Any) -> bool:
    """``trainer.compute_copy`` resolved (``auto``: on unless checkpointing); it only applies where a model
    autocasts, which the plan's numerics decide per launch mode."""
    key = config.trainer.compute_copy
    return (not checkpointing(config)) if key == "auto" else bool(key)


def token_budget(config: Any) -> int | None:
    """``trainer.max_tokens_per_micro_batch`` as a fixed bound; None where the largest micro-batch is the sample
    count's: the key off (null), or ``auto``, whose budget IS the count split's costliest micro-batch (it packs
    more samples into fewer forwards, never a larger one)."""
    budget = config.trainer.max_tokens_per_micro_batch
    return budget if isinstance(budget, int) else None


def fix_keys(config: Any) -> dict[str, str]:
    """role -> the config key a suggested fix sets (the schema's own, so a suggestion is always a valid key)."""
    return {"checkpointing": "trainer.gradient_checkpointing", "token_budget": "trainer.max_tokens_per_micro_batch"}


def hf_config(config: Any, shape: str | None = None) -> tuple[Any, str]:
    """The model's transformers config: a named shape (:mod:`mmrlhf.models.shapes`) or ``model.pretrain``'s
    ``config.json`` (a local folder; nothing is downloaded). Returns (config, name)."""
    from transformers import AutoConfig

    from mmrlhf.models.shapes import shape_config, shape_names

    if shape:
        return shape_config(shape), shape
    path = config.model.pretrain
    if not path:
        raise PlanError("the plan needs the model's dimensions: set model.pretrain to a local model folder, or plan "
                        f"for a named shape with --shape NAME (known: {', '.join(shape_names())})")
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise PlanError(f"model.pretrain={path}: no config.json there (the plan reads a local folder and downloads "
                        f"nothing); give a local model folder, or --shape NAME (known: {', '.join(shape_names())})")
    try:
        cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise PlanError(f"model.pretrain={path}: config.json unreadable ({exc})") from exc
    return cfg, folder.name


def teacher_bytes(config: Any, compute_bytes: int, teacher_shape: str | None = None) -> int:
    """The distillation teacher's weights in ``model.dtype`` (0 without distillation): a named shape
    (``--teacher-shape``) or ``model.teacher``'s ``config.json``."""
    from mmrlhf.models.memory.counts import meta_model
    from mmrlhf.models.shapes import shape_config, shape_names

    a, teacher = config.algorithm, config.model.teacher
    if not (teacher and (a.distill_coef > 0 or a.distill_loss_coef > 0)):
        return 0
    if teacher_shape:
        cfg = shape_config(teacher_shape)
    else:
        folder = Path(teacher)
        if not (folder / "config.json").is_file():
            raise PlanError(f"model.teacher={teacher}: no config.json there (the plan reads a local folder); give a "
                            f"local model folder, or --teacher-shape NAME (known: {', '.join(shape_names())})")
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=config.model.trust_remote_code)
    return compute_bytes * sum(p.numel() for p in meta_model(cfg).parameters())


def judge_shares(config: Any) -> tuple[tuple[float, bool], ...]:
    """The in-process vLLM judges (``backend: vllm`` reward sources): (their engine's GPU share, sleeps between
    calls). A ``ray`` judge runs on GPUs of its own, an ``endpoint`` one elsewhere."""
    from mmrlhf.config.rollout import GPU_MEMORY_UTILIZATION

    return tuple((float(src.engine.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)), bool(src.sleep))
                 for src in config.reward.label_map.values()
                 if getattr(src, "type", "") == "judge" and src.backend == "vllm")


def sequence_lengths(config: Any) -> tuple[int, int]:
    """(prompt, response) tokens of the longest sample a run can make."""
    d, r = config.data, config.rollout
    if config.agent.enabled:  # a trajectory: prompt, turns and observations within the context budget
        total = config.agent.max_context_tokens or r.max_model_len
        return min(d.prompt_max_len, total - 1), total - min(d.prompt_max_len, total - 1)
    total = d.prompt_max_len + r.max_new_tokens
    if r.engine == "vllm":
        total = min(total, r.max_model_len)  # the engine's context bounds prompt + response
    response = min(r.max_new_tokens, total - 1)
    return total - response, response


def vision_tokens(config: Any, facts: ModelFacts, prompt: int) -> int:
    """Vision tokens of one sample, at most: the images a prompt may carry at ``data.image_max_pixels`` each, or
    the whole prompt when the pixels are not bounded."""
    d, r = config.data, config.rollout
    images = (config.agent.max_images + 1) if config.agent.enabled else (r.limit_images_per_prompt or 1)
    if d.image_max_pixels is None:
        return prompt
    return min(prompt, images * (d.image_max_pixels // facts.vision.patch_pixels))


def micro_batch(samples: int, prompt: int, response: int, *, layout: str, group: int, row_limit: int,
                vision: int, merge: int, attn: str) -> MicroBatch:
    """The forward's view of ``samples`` samples of ``prompt + response`` tokens in ``layout`` (padded: one row each;
    packed: one row; grouped: one row per prompt group of ``group`` samples, rows of at most ``row_limit``)."""
    seq, real = prompt + response, None
    if layout == "packed":
        rows, span = 1, samples * seq
    elif layout == "grouped":  # each group's prompt (and its images) once, then its responses
        per_group = min(samples, group)
        groups = -(-samples // per_group)
        row = prompt + per_group * response
        span = min(row, row_limit)
        rows, real = groups * -(-row // span), groups * (row + (-(-row // span) - 1) * prompt)
    else:
        rows, span = samples, seq
    images = -(-samples // group) if layout == "grouped" else samples
    return MicroBatch(rows=rows, row_tokens=span, response_tokens=samples * response,
                      vision_patches=images * vision * merge, mask=attn in ("sdpa", "eager"), eager=attn == "eager",
                      real_tokens=real)


def layout_of(config: Any) -> str:
    from mmrlhf.models.shared_prompt import resolve_shared_prompt

    t, r = config.trainer, config.rollout
    if resolve_shared_prompt(t.shared_prompt, config.model.attn_implementation, r.n_samples_per_prompt,
                             multi_turn=config.agent.enabled):
        return "grouped"
    return "packed" if t.packing_samples else "padded"


def _chunk_size() -> int:
    from mmrlhf.models.actor import ActorVL

    return int(inspect.signature(ActorVL.__init__).parameters["chunk_size"].default)


def visible_gpu_bytes() -> int | None:
    """Total memory of the visible accelerator (None: there is none)."""
    import torch

    if not torch.accelerator.is_available():
        return None
    try:
        return int(torch.accelerator.get_memory_info()[1])
    except (AttributeError, RuntimeError):
        return None


def plan_inputs(config: Any, facts: ModelFacts, *, gpu_gib: float | None = None,
                ranks: int | None = None, teacher_shape: str | None = None,
                gpus_per_node: int | None = None) -> PlanInputs:
    """:class:`PlanInputs` of ``config`` for ``facts``' model on GPUs of ``gpu_gib`` GiB (default: the visible
    accelerator's, else 80), a torchrun world of ``ranks`` over all nodes (default ``WORLD_SIZE``, else 8) on nodes
    of ``gpus_per_node`` GPUs (default 8: not ``LOCAL_WORLD_SIZE``, which vLLM's CPU platform sets to 1 in any
    process that started an engine); a distillation teacher of shape
    ``teacher_shape`` (default: ``model.teacher``'s config)."""
    from mmrlhf.models.precision import lora_base_dtype, precision

    m, t, r, dist, algo = config.model, config.trainer, config.rollout, config.distributed, config.algorithm
    p = precision(m.dtype)
    gpu = int(gpu_gib * GIB) if gpu_gib else (visible_gpu_bytes() or int(DEFAULT_GPU_GIB * GIB))
    prompt, response = sequence_lengths(config)
    layout = layout_of(config)
    vision = vision_tokens(config, facts, prompt)

    def mb(samples: int) -> MicroBatch:
        return micro_batch(samples, prompt, response, layout=layout, group=r.n_samples_per_prompt,
                           row_limit=t.shared_prompt_max_tokens, vision=vision, merge=facts.vision.merge,
                           attn=m.attn_implementation)

    budget = token_budget(config)
    train_samples = max(1, budget // (prompt + response)) if budget else t.micro_train_batch_size
    need_reference = algo.kl_loss_coef > 0 or algo.kl_reward_coef > 0
    backend = dist.backend
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "auto":
        backend = "torchrun" if world > 1 else "single"
    engine_dtype = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}[r.dtype]  # auto: bfloat16 on CUDA
    return PlanInputs(
        gpu_bytes=gpu, compute_bytes=p.compute.itemsize, master_bytes=p.master.itemsize,
        reference=need_reference and not (m.lora.rank and not m.reference),
        critic=algo.advantage_estimator == "gae", train=mb(train_samples), score=mb(r.micro_rollout_batch_size),
        checkpointing=checkpointing(config), chunk=_chunk_size(), engine=r.engine, engine_bytes=engine_dtype,
        utilization=r.gpu_memory_utilization, sleep=r.enable_sleep and r.engine == "vllm",
        tensor_parallel=r.tensor_parallel_size, max_model_len=r.max_model_len,
        generate_rows=r.micro_rollout_batch_size * r.n_samples_per_prompt,
        bucket_bytes=r.weight_sync_bucket_mb * 2**20, lora_merged=bool(m.lora.rank) and m.lora.sync == "merged",
        backend=backend, ranks=ranks or (world if world > 1 else DEFAULT_RANKS),
        rollout_actors=dist.num_rollout_actors,
        rollout_gpus=max(1, int(dist.rollout_actor_gpus or r.tensor_parallel_size)),
        trainer_actors=dist.num_trainer_actors,
        gpus_per_node=gpus_per_node or DEFAULT_GPUS_PER_NODE,
        keys=fix_keys(config), compute_copy=compute_copy(config),
        lora_base_bytes=lora_base_dtype(m, "cuda").itemsize if m.lora.rank else 0,  # the plan is a GPU's
        offload=dist.offload == "params", teacher_bytes=teacher_bytes(config, p.compute.itemsize, teacher_shape),
        judges=judge_shares(config), rollout_models=rollout_actor_models(config),
        routing_bytes=(mb(train_samples).tokens * facts.decoder.layers * facts.decoder.top_k * INT64
                       if r.routing_replay == "replay" and facts.decoder.moe_layers else 0))


def facts_of(config: Any, shape: str | None = None) -> ModelFacts:
    """The model facts of ``config`` (or of shape ``shape``) under its freeze / LoRA settings."""
    cfg, name = hf_config(config, shape)
    t = config.trainer
    return model_facts(cfg, freeze_vision_tower=t.freeze_vision_tower, freeze_merger=t.freeze_merger,
                       lora=config.model.lora, name=name)
