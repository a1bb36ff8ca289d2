"""Config tree -> a ready ``FastExperienceMaker`` (or ``NaiveExperienceMaker``).

This is trainer-level wiring: the one function below the CLI that reads several sections. Everything it builds
receives plain arguments or its own section only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from mmrlhf.algorithms.kl import kl_controller
from mmrlhf.config.schema import MMRLHFConfig
from mmrlhf.devices import resolve_device
from mmrlhf.experience.kinds import KindSetup, build_rollout_kind, kind_class, resolve_kind_name
from mmrlhf.experience.settings import experience_settings
from mmrlhf.models.precision import lora_base_dtype, precision, store_frozen_linears

logger = logging.getLogger(__name__)


@dataclass
class ExperienceStack:
    """What the builder made (the trainer keeps references to the models and the engine)."""

    maker: Any
    actor: Any
    reference: Any
    critic: Any
    engine: Any
    tokenizer: Any
    processor: Any
    teacher: Any = None  # on-policy distillation teacher (None without distillation)


def build_experience_maker(config: MMRLHFConfig, *, critic: Any = None, device: str | torch.device | None = None,
                           policy_path: str | None = None, before_engine: Any = None,
                           score_reference: bool = True, score_teacher: bool = True,
                           score_policy: bool = True, generate_only: bool = False) -> ExperienceStack:
    """Build actor, reference (if KL is used), engine, data processor, reward engine and the maker.

    ``policy_path``: where the actor and the engine load the policy from (default ``model.pretrain``; a resumed run
    passes its checkpoint's model folder), while the reference stays the initial policy. ``before_engine(actor)``
    runs before the engine is built (the trainer freezes parameters there, so a transformers engine sharing the
    actor sees the final module). ``score_reference=False``: no reference here although the KL loss needs one (a Ray
    rollout actor whose trainer actors score it: :func:`~mmrlhf.models.ray_placement.reference_on_trainers`); the
    experiences then carry none. ``score_teacher=False``: likewise for the distillation loss term's teacher
    (:func:`~mmrlhf.models.ray_placement.teacher_on_trainers`). ``score_policy=False``: the actor is the policy's
    modules without weights (:func:`weightless_policy`: the engine, the processor and the samples read its config
    only) and the maker runs no policy forward (:func:`~mmrlhf.models.ray_placement.policy_on_trainers`).
    ``generate_only=True``: a maker for :meth:`~mmrlhf.experience.fast_maker.FastExperienceMaker.generate_rollout`
    only (a Ray rollout actor whose trainer actors make the experiences with :func:`build_scoring_maker`,
    :func:`~mmrlhf.models.ray_placement.experiences_on_trainers`): a weightless policy, no reference, teacher,
    critic or KL controller."""
    from transformers import AutoProcessor

    from mmrlhf.data.processor import MultimodalDataProcessor
    from mmrlhf.experience.fast_maker import FastExperienceMaker
    from mmrlhf.rewards.engine import RewardComputationEngine
    from mmrlhf.rollout.builder import build_engine

    model_cfg = config.model
    if not model_cfg.pretrain:
        raise ValueError("model.pretrain is empty: set it to a model directory")
    target = torch.device(device) if device is not None else resolve_device(config.trainer.device)
    lora = model_cfg.lora
    if generate_only:
        score_reference = score_teacher = False
        critic = None
        # a transformers engine generates with the policy's module itself: its weights are the engine's
        score_policy = config.rollout.engine != "vllm"
    if score_policy:
        actor, adapter_path = build_policy(config, policy_path, device=target, before_adapters=before_engine)
    else:
        actor, adapter_path = weightless_policy(config, before_adapters=before_engine,
                                                adapters=not generate_only), None
    adapter = actor.adapter
    policy_path = policy_path or model_cfg.pretrain
    settings = maker_settings(config, target)
    if generate_only:  # stage 2 runs on the trainer actors: nothing here scores, shapes or keeps running state
        settings = dataclasses.replace(settings, need_reference=False, kl_in_reward=False, distill_coef=0.0,
                                       distill_topk=0, score_policy=False, compute_entropy=False,
                                       routing_metrics=False, reward_normalization=False)
    if not score_reference:
        if settings.kl_in_reward:
            raise ValueError("algorithm.kl_reward_coef > 0 shapes the rewards with the reference: the experience "
                             "maker must hold it")
        settings = dataclasses.replace(settings, need_reference=False)
    if not score_teacher:
        if settings.distill_coef > 0:
            raise ValueError("algorithm.distill_coef > 0 shapes the advantages with the teacher: the experience "
                             "maker must hold it")
        settings = dataclasses.replace(settings, distill_topk=0)
    if not score_policy:
        from mmrlhf.models.ray_placement import policy_scoring_blockers

        if settings.need_reference or settings.distill_coef > 0 or critic is not None or settings.routing_metrics:
            raise ValueError("the experience maker must score the policy here: "
                             + "; ".join(policy_scoring_blockers(config) or ["a reference, teacher or critic reads it"]))
        settings = dataclasses.replace(settings, score_policy=False, compute_entropy=False)
    reference, teacher = scoring_models(config, actor, settings, target)
    processor = AutoProcessor.from_pretrained(model_cfg.pretrain, trust_remote_code=model_cfg.trust_remote_code)
    tokenizer = processor.tokenizer
    engine = build_engine(config.rollout, model_cfg.pretrain if lora.rank else policy_path, family=model_cfg.family,
                          hf_model=actor.model, tokenizer=tokenizer, trust_remote_code=model_cfg.trust_remote_code,
                          lora_rank=lora.rank if lora.sync == "vllm_lora" else 0,
                          lora_vision=lora.vision != "none",
                          hf_compute_dtype=actor.compute_dtype,
                          images_per_prompt=config.agent.max_images if config.agent.enabled else None)
    if adapter_path:
        from mmrlhf.rollout.weight_sync import sync_weights

        sync_weights(actor.model, engine)  # the engine loaded the base model: bring it to the loaded adapter
    data_processor = MultimodalDataProcessor.from_config(processor, adapter, config.data)
    rewards = RewardComputationEngine.from_config(config.reward)
    controller = _kl_controller(config, settings)
    sampling = policy_sampling(config, tokenizer, actor.model)
    agent = build_agent_loop(config, engine=engine, tokenizer=tokenizer, adapter=adapter,
                             data_processor=data_processor, model=actor.model)
    kind = build_rollout_kind(rollout_kind_name(config), KindSetup(agent, config.agent.out_of_budget_reward),
                              config.rollout.kind_options)
    maker = FastExperienceMaker(actor, engine, data_processor, rewards, tokenizer, settings, sampling,
                                initial_model=reference, critic=critic, kl_controller=controller, kind=kind,
                                teacher_model=teacher)
    return ExperienceStack(maker, actor, reference, critic, engine, tokenizer, processor, teacher)


def maker_settings(config: MMRLHFConfig, device: torch.device) -> Any:
    """The experience maker's :class:`~mmrlhf.experience.settings.ExperienceSettings` of ``config`` for models on
    ``device`` (which decides the masked-attention kernel, and so ``trainer.shared_prompt: auto``)."""
    m = config.model
    return experience_settings(config.algorithm, config.rollout, config.trainer,
                               attn_implementation=m.attn_implementation,
                               multi_turn=rollout_kind_class(config).multi_turn,
                               masked_kernel=masked_kernel(m, device), agent=config.agent)


def scoring_models(config: MMRLHFConfig, actor: Any, settings: Any, device: torch.device) -> tuple[Any, Any]:
    """The reference and the distillation teacher ``settings`` need beside ``actor`` (None where not needed). With
    LoRA and no ``model.reference`` the reference is the actor's own module with its adapters off (no memory)."""
    m = config.model
    reference = None
    if settings.need_reference and m.lora.rank and not m.reference:
        from mmrlhf.models.lora import AdapterOffScorer

        reference = AdapterOffScorer(actor)  # the base model: the actor's own module with its adapters off
    elif settings.need_reference:
        reference = load_model(m, m.reference or m.pretrain, actor.adapter, trainable=False,
                               routing_replay=config.rollout.routing_replay).to(device).eval()
        reference.requires_grad_(False)
    teacher = build_teacher(config, actor.adapter, device) if settings.teacher_needed else None
    return reference, teacher


def _kl_controller(config: MMRLHFConfig, settings: Any) -> Any:
    a = config.algorithm
    return kl_controller(a.kl_controller, a.kl_reward_coef, target=a.kl_target,
                         horizon=a.kl_horizon) if settings.kl_in_reward else None


def build_scoring_maker(config: MMRLHFConfig, actor: Any, tokenizer: Any, *, critic: Any = None,
                        device: torch.device) -> ExperienceStack:
    """The experience maker's second stage without an engine (:meth:`~mmrlhf.experience.fast_maker.
    FastExperienceMaker.experiences_from` only): the Ray trainer actors' where they make the experiences.
    ``actor`` is this rank's policy (sharded later with the reference and the teacher made here, as the torchrun
    ranks' are); ``critic`` the trainer's. The rows it scores come from the rollout actors' generate-only makers
    (:func:`build_experience_maker` with ``generate_only``)."""
    from mmrlhf.experience.fast_maker import FastExperienceMaker

    settings = maker_settings(config, device)
    reference, teacher = scoring_models(config, actor, settings, device)
    maker = FastExperienceMaker(actor, None, None, None, tokenizer, settings,
                                policy_sampling(config, tokenizer, actor.model), initial_model=reference,
                                critic=critic, kl_controller=_kl_controller(config, settings), teacher_model=teacher)
    return ExperienceStack(maker, actor, reference, critic, None, tokenizer, None, teacher)


def build_teacher(config: MMRLHFConfig, adapter: Any, device: torch.device) -> Any:
    """The on-policy distillation teacher (``model.teacher``), loaded as the reference is: frozen, stored in
    ``model.dtype``, one full copy on ``device``. It scores the student's batches, built by the student's adapter
    and processor, so it must be of the student's family (same vision placeholders, same rope index) and tokenizer:
    anything else is refused here, before a step runs."""
    from mmrlhf.models.adapters import get_adapter

    model_cfg = config.model
    own = get_adapter(model_cfg.teacher, "auto")
    if type(own) is not type(adapter):
        raise ValueError(f"model.teacher={model_cfg.teacher!r} is a {type(own).__name__} model but the student is "
                         f"a {type(adapter).__name__} one: the teacher scores the student's batches, so it must be of "
                         "the same family (and tokenizer)")
    _check_same_tokenizer(model_cfg.pretrain, model_cfg.teacher, model_cfg.trust_remote_code)
    teacher = load_model(model_cfg, model_cfg.teacher, adapter, trainable=False,
                         routing_replay="none").to(device).eval()
    teacher.requires_grad_(False)
    return teacher


def _check_same_tokenizer(student: str, teacher: str, trust_remote_code: bool) -> None:
    """The teacher reads the student's token ids: both vocabularies must map every token to the same id (the
    embedding tables may differ in padded size, e.g. Qwen2.5-VL 3B 151936 vs 7B 152064 rows)."""
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(student, trust_remote_code=trust_remote_code)
    b = AutoTokenizer.from_pretrained(teacher, trust_remote_code=trust_remote_code)
    if a.get_vocab() != b.get_vocab():
        raise ValueError(f"model.teacher={teacher!r} has another tokenizer than model.pretrain={student!r}: on-policy "
                         "distillation scores the student's token ids with the teacher, so both must share one")


def rollout_kind_name(config: MMRLHFConfig) -> str:
    """``rollout.kind`` with ``auto`` decided by the ``agent`` section."""
    return resolve_kind_name(config.rollout.kind, config.agent.enabled)


def rollout_kind_class(config: MMRLHFConfig) -> type:
    """The run's rollout kind class (checked against the protocol): what the builders read its facts from
    (``multi_turn``) before anything is built."""
    return kind_class(rollout_kind_name(config))


def policy_sampling(config: MMRLHFConfig, tokenizer: Any, model: Any) -> Any:
    """The run's sampling settings, ``rollout.allowed_tokens`` applied: what every engine samples from and every
    scorer of the policy (experience makers, Ray trainer ranks) excludes."""
    from mmrlhf.rollout.builder import sampling_settings

    vocab = max(len(tokenizer), int(model.get_output_embeddings().weight.shape[0]))
    return sampling_settings(config.rollout, forbidden=restricted_vocabulary(config.rollout, tokenizer, vocab))


def restricted_vocabulary(rollout_cfg: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    """The ids ``rollout.allowed_tokens`` forbids: every other token of the vocabulary (none when the list is
    empty). Each allowed entry must be exactly one token; the engines never sample the rest and the models score
    the same restricted distribution."""
    allowed = list(rollout_cfg.allowed_tokens)
    if not allowed:
        return []
    ids = set()
    for text in allowed:
        tid = tokenizer.convert_tokens_to_ids(text)
        if tid is None or tid == getattr(tokenizer, "unk_token_id", None):
            encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise ValueError(f"rollout.allowed_tokens: {text!r} is {len(encoded)} tokens, not one")
            tid = encoded[0]
        ids.add(int(tid))
    return sorted(set(range(vocab_size)) - ids)


def build_agent_loop(config: MMRLHFConfig, *, engine: Any, tokenizer: Any, adapter: Any, data_processor: Any,
                     model: Any) -> Any:
    """The multi-turn turn loop when ``agent`` is configured (None otherwise); the tools' schemas go into every
    prompt through the chat template."""
    if not config.agent.enabled:
        return None
    from mmrlhf.agents.builder import build_agent, build_tool_map
    from mmrlhf.agents.tools import tool_schemas
    from mmrlhf.experience.agent_rows import encoder_of
    from mmrlhf.rollout.base import stop_token_ids

    tools = build_tool_map(config.agent)
    data_processor.set_tools(tool_schemas(tools) if tools else None)
    eos = stop_token_ids(model, tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
    return build_agent(config.agent, engine=engine, tokenizer=tokenizer, adapter=adapter,
                       encode_images=encoder_of(data_processor), eos_ids=eos,
                       max_new_tokens=config.rollout.max_new_tokens, max_model_len=config.rollout.max_model_len,
                       tools=tools)


def build_policy(config: MMRLHFConfig, policy_path: str | None, *, device: torch.device,
                 before_adapters: Any = None) -> tuple[Any, Any]:
    """The trained policy of every launch mode: an :class:`~mmrlhf.models.actor.ActorVL` of ``model.pretrain`` (or
    of a resumed run's ``policy_path``) on ``device``; ``before_adapters(actor)`` runs before LoRA adapters are added
    (the trainer freezes parameters there, so only the adapters train). Returns the actor and the adapter folder it
    loaded (None: none). With LoRA the actor is always the base model plus adapters: a resumed run's adapter sits
    beside its ``model/``."""
    from mmrlhf.models.adapters import get_adapter

    model_cfg, lora = config.model, config.model.lora
    check_lora_settings(config)
    adapter = get_adapter(model_cfg.pretrain, model_cfg.family)
    path = model_cfg.pretrain if lora.rank else (policy_path or model_cfg.pretrain)
    actor = load_model(model_cfg, path, adapter, trainable=True,
                       routing_replay=config.rollout.routing_replay).to(device)
    if before_adapters is not None:
        before_adapters(actor)
    adapter_path = None
    if lora.rank:
        from mmrlhf.models.lora import apply_lora, resume_adapter_path

        adapter_path = resume_adapter_path(policy_path) or lora.adapter or None
        # fresh adapters draw their A matrices from the random state: fixed here (trainer.seed), so every training
        # rank makes the same ones (FSDP2 shards each rank's own values) whatever ran before on each
        with torch.random.fork_rng(devices=[] if torch.device(device).type == "cpu" else [torch.device(device)],
                                   device_type=torch.device(device).type):
            torch.manual_seed(config.trainer.seed)
            apply_lora(actor, lora, adapter_path=adapter_path)
        base = lora_base_dtype(model_cfg, device)
        if base != precision(model_cfg.dtype).master:
            cast = store_frozen_linears(actor, base)
            logger.info("model.lora.base_dtype: %d frozen Linear parameters (%.2f GiB) stored in %s", cast,
                        cast * base.itemsize / 2**30, str(base).removeprefix("torch."))
    return actor, adapter_path


def weightless_policy(config: MMRLHFConfig, *, before_adapters: Any = None, adapters: bool = True) -> Any:
    """The policy's :class:`~mmrlhf.models.actor.ActorVL` with its parameters on the meta device (no memory): what a
    Ray rollout actor that scores nothing with it reads (the model config, the generation config's stop ids, the
    family adapter, the vocabulary's size). Its engine loads the weights itself and receives the trainer's
    updates directly. ``before_adapters(actor)``: as :func:`build_policy`'s (the parameters' ``requires_grad``).
    ``adapters=False``: a LoRA policy's base model alone (its engine receives merged weights from the trainers)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.adapters import get_adapter

    model_cfg = config.model
    if model_cfg.lora.rank and adapters:
        raise ValueError("model.lora.rank > 0: a rollout actor's LoRA engine is synced from a policy copy with weights")
    path, remote = model_cfg.pretrain, model_cfg.trust_remote_code
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path, trust_remote_code=remote),
                                                        trust_remote_code=remote)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)  # its stop ids, as from_pretrained reads
    except OSError:  # none saved: the one derived from the model config stays, as from_pretrained keeps it
        pass
    actor = ActorVL(model, get_adapter(path, model_cfg.family), masked_attention=model_cfg.masked_attention,
                    routing_replay=config.rollout.routing_replay,
                    linear_attention_kernel=model_cfg.linear_attention_kernel)
    if before_adapters is not None:
        before_adapters(actor)
    return actor


def masked_kernel(model_cfg: Any, device: torch.device | str) -> str:
    """``model.masked_attention`` resolved for the trainer's ``device`` (``flex`` / ``dense``): what the models'
    packed and grouped rows will run, and so whether the shared-prompt layout is expressible."""
    from mmrlhf.models.attention import resolve_masked_attention

    return resolve_masked_attention(model_cfg.masked_attention, device, model_cfg.attn_implementation)


def load_model(model_cfg: Any, path: str, adapter: Any, *, trainable: bool, routing_replay: str = "none") -> Any:
    """An :class:`~mmrlhf.models.actor.ActorVL` of ``path`` (on the CPU) under the precision rule of
    :mod:`mmrlhf.models.precision`: a model that trains (actor, critic body) keeps float32 parameters and autocasts
    its forwards to ``model.dtype``; one that never trains (the reference) is stored in ``model.dtype``.
    ``routing_replay``: ``rollout.routing_replay`` (``replay`` holds its routers to the engine's expert choice)."""
    from mmrlhf.models.actor import ActorVL

    p = precision(model_cfg.dtype)
    return ActorVL.from_pretrained(path, adapter=adapter, dtype=p.master if trainable else p.frozen,
                                   compute_dtype=p.autocast_dtype if trainable else None,
                                   attn_implementation=model_cfg.attn_implementation,
                                   masked_attention=model_cfg.masked_attention, routing_replay=routing_replay,
                                   linear_attention_kernel=model_cfg.linear_attention_kernel,
                                   trust_remote_code=model_cfg.trust_remote_code)


def check_lora_settings(config: MMRLHFConfig) -> None:
    """Refuse LoRA combinations that cannot work, naming the keys."""
    lora = config.model.lora
    if lora.rank and not config.trainer.freeze_vision_tower:
        raise ValueError("trainer.freeze_vision_tower=false with model.lora.rank > 0: with LoRA only the adapters "
                         "train; to adapt the vision tower set model.lora.vision=tower (or both) instead")
    if not lora.rank or lora.sync != "vllm_lora":
        return
    if config.rollout.engine != "vllm":
        raise ValueError(f"model.lora.sync=vllm_lora needs rollout.engine=vllm (got {config.rollout.engine!r}); "
                         "use model.lora.sync=merged")
