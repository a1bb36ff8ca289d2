"""Config tree -> a ready :class:`~mmrlhf.trainer.loop.Trainer` (the only place below the CLI that reads the
``trainer`` section; everything it builds receives plain values)."""

from __future__ import annotations

import logging
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mmrlhf.algorithms.checks import check_params
from mmrlhf.algorithms.losses import POLICY_LOSSES
from mmrlhf.config.budget import Budget
from mmrlhf.config.schema import MMRLHFConfig
from mmrlhf.models.compute_copy import ComputeCopy
from mmrlhf.models.placement import module_device
from mmrlhf.models.gradient_checkpointing import checkpoint_blocks
from mmrlhf.models.sharding import shard_models
from mmrlhf.parallel.engine_groups import group_seed_index
from mmrlhf.parallel.world import World, single
from mmrlhf.rollout import vllm_quiet
from mmrlhf.rollout.types import rank_seed
from mmrlhf.startup import loaded
from mmrlhf.trainer.checkpoint import CheckpointManager, check_resume_mode, read_trainer_state
from mmrlhf.trainer.critic_update import CriticUpdater, CriticUpdateSettings
from mmrlhf.trainer.loop import LoopSettings, Trainer, TrainerParts
from mmrlhf.trainer.minibatch import GuardedStepper
from mmrlhf.trainer.optim import build_optimizer, build_scheduler, freeze_vision
from mmrlhf.trainer.policy_update import PolicyUpdater, PolicyUpdateSettings
from mmrlhf.trainer.preflight import check_before_models
from mmrlhf.trainer.reporting import StepReporter
from mmrlhf.trainer.resume_changes import apply_changes, check_changes
from mmrlhf.trainer.rollouts import LocalRollouts, LocalSettings, RolloutSource
from mmrlhf.trainer.run_checkpoint import RANK_SEEDS, rank_seeds_of
from mmrlhf.trainer.state import seed_everything
from mmrlhf.trainer.tracking import METRICS_FILE, TENSORBOARD_DIR, WANDB_ID_FILE

logger = logging.getLogger(__name__)


def resolve_rollout_correction(algorithm: Any, *, engine: str, engine_dtype: str, train_dtype: str,
                               device: torch.device | str) -> str:
    """``auto`` -> ``tis`` unless the engine and the trainer are measured to compute the same log-probs.

    ``none`` only where that was measured: the transformers engine (it IS the actor's module, generating under the
    actor's precision), and a vLLM engine on the CPU with engine and trainer both in float32 (they agree to ~1e-6,
    docs/environment.md). Everywhere else vLLM and transformers run different kernels (on a GPU: vLLM's attention
    and fused kernels against transformers' sdpa, whatever the dtypes; a bf16 engine against an fp32 trainer on
    the CPU: <= 0.0045 apart), so the truncated importance weight corrects the gap. ``device``: the trainer's
    device (vLLM runs on the same kind of machine), passed in so the rule is testable off a GPU."""
    if algorithm.rollout_correction != "auto":
        return algorithm.rollout_correction
    if engine == "transformers":
        return "none"
    cpu = torch.device(device).type == "cpu"
    return "none" if cpu and engine_dtype == train_dtype == "float32" else "tis"


def policy_update_settings(config: MMRLHFConfig, correction: str) -> PolicyUpdateSettings:
    """The policy update's settings; the loss's parameters are checked against it here, before any model loads."""
    a, t = config.algorithm, config.trainer
    params = dict(a.policy_loss_params)
    if a.dual_clip is not None:
        if a.policy_loss not in ("ppo", "vanilla"):
            raise ValueError(f"algorithm.dual_clip applies to the 'ppo' loss, not {a.policy_loss!r}")
        params["dual_clip"] = a.dual_clip
    check_params(POLICY_LOSSES.get(a.policy_loss), params, f"algorithm.policy_loss_params of {a.policy_loss!r}")
    return PolicyUpdateSettings(
        train_batch_size=t.train_batch_size, micro_batch_size=t.micro_train_batch_size, ppo_epochs=t.ppo_epochs,
        loss=a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high, loss_params=params, agg=a.loss_agg,
        norm_len=a.loss_agg_norm_len, entropy_coef=a.entropy_coef, kl_loss_coef=a.kl_loss_coef,
        moe_aux_loss_coef=a.moe_aux_loss_coef, distill_loss_coef=a.distill_loss_coef,
        distill_loss_kl=a.distill_loss_kl,
        kl_loss_estimator=a.kl_loss_estimator, high_entropy_top_p=a.high_entropy_top_p, correction=correction,
        correction_level=a.rollout_correction_level, correction_cap=a.rollout_correction_cap,
        correction_lower=a.rollout_correction_lower, packing=t.packing_samples,
        max_tokens_per_micro_batch=update_token_budget(config), **_layout(config))


def update_token_budget(config: MMRLHFConfig) -> Budget:
    """``trainer.max_tokens_per_micro_batch`` for the updates: as configured where the loss does not depend on how a
    mini-batch is split. ``seq-mean-token-sum-norm`` without ``algorithm.loss_agg_norm_len`` divides each
    response's loss by its MICRO-batch's padded length, so regrouping samples changes the gradient: ``auto`` keeps
    the count split there (an explicit budget is refused when the config loads)."""
    t, a = config.trainer, config.algorithm
    per_micro_length = a.loss_agg == "seq-mean-token-sum-norm" and a.loss_agg_norm_len is None
    if t.max_tokens_per_micro_batch == "auto" and per_micro_length:
        return None
    return t.max_tokens_per_micro_batch


def _layout(config: MMRLHFConfig) -> dict[str, Any]:
    """The forward layout keys the policy and critic updates share with the experience maker."""
    from mmrlhf.devices import resolve_device
    from mmrlhf.experience.builder import masked_kernel, rollout_kind_class
    from mmrlhf.models.shared_prompt import resolve_shared_prompt

    t = config.trainer
    return {"shared_prompt": resolve_shared_prompt(t.shared_prompt, config.model.attn_implementation,
                                                   config.rollout.n_samples_per_prompt,
                                                   multi_turn=rollout_kind_class(config).multi_turn,
                                                   masked_kernel=masked_kernel(config.model,
                                                                               resolve_device(t.device))),
            "shared_prompt_max_tokens": t.shared_prompt_max_tokens}


def _engine_dtype(config: MMRLHFConfig) -> str:
    """The precision the rollout engine computes in: ``rollout.dtype`` for vLLM, the actor's for transformers."""
    if config.rollout.engine == "transformers":
        return config.model.dtype  # the engine is the actor's own module
    from mmrlhf.rollout.vllm_setup import engine_dtype

    return engine_dtype(config.rollout.dtype)


def _prepare_output(out: Path, checkpoints: CheckpointManager, *, resume: bool, overwrite: bool,
                    strict: bool = False) -> Path | None:
    """The checkpoint to resume from (None: a fresh run), verified against its manifest (a damaged latest one falls
    back to the newest intact one, or with ``strict`` is refused: :meth:`CheckpointManager.resume_point`); refuses to
    mix a fresh run into an old one, and a second live process writing into the same folder
    (:func:`~mmrlhf.trainer.output_lock.lock_output_dir`). Rank 0 alone, in every launch mode."""
    from mmrlhf.trainer.output_lock import lock_output_dir

    lock_output_dir(out)  # before anything is read or cleaned: the other run may be mid-save
    checkpoints.remove_orphans()  # a save that was killed (or ran out of disk) left a half-written folder
    if resume:
        return checkpoints.resume_point(strict=strict)
    if checkpoints.checkpoints() or (out / "metrics.jsonl").exists():
        if not overwrite:
            raise FileExistsError(
                f"{out} already holds a run (metrics or checkpoints): continue it with --resume, start over with "
                "trainer.overwrite_output_dir=true, or choose another trainer.output_dir")
    if overwrite:
        clear_run_outputs(out, checkpoints.root)
    return None


# What a run writes into its output_dir (besides checkpoints/): an overwrite removes all of it, so that no old
# TensorBoard event, per-step report or W&B run id mixes into the new run's record. Other files stay.
RUN_OUTPUTS = (METRICS_FILE, "config.yaml", "curves.png", "report.html", "reports", TENSORBOARD_DIR, WANDB_ID_FILE)


def clear_run_outputs(out: Path, checkpoint_root: Path) -> list[str]:
    """Remove a previous run's outputs from ``out`` (``trainer.overwrite_output_dir``); returns what was removed."""
    removed = []
    for path in (checkpoint_root, *(out / name for name in RUN_OUTPUTS)):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(path.name)
    if removed:
        logger.info("trainer.overwrite_output_dir: removed %s from %s", ", ".join(removed), out)
    return removed


@dataclass
class Rollouts:
    """What a launch mode's rollout factory returns: the policy it built (on this rank's device) and where the
    experiences come from."""

    actor: Any  # ActorVL, trainable (the updater trains it; the builder shards it in a world of several ranks)
    source: RolloutSource
    processor: Any  # saved beside the model in checkpoints
    tokenizer: Any
    # the frozen models the source scores with on this rank (the reference, a distillation teacher): sharded and
    # offloaded with the policy (FSDP2, same plan: mmrlhf.models.sharding.shard_models); none where the rank scores
    # nothing (a Ray trainer actor) or the reference is the actor's own module (LoRA)
    scorers: tuple[Any, ...] = ()


# (config, world, critic, policy_path, freeze) -> Rollouts; policy_path: the checkpoint's model/ on a resume
RolloutFactory = Callable[[MMRLHFConfig, World, Any, "str | None", Callable[[Any], None]], Rollouts]


def local_rollouts(config: MMRLHFConfig, world: World, critic: Any, policy_path: str | None,
                   freeze: Callable[[Any], None], *, share: tuple[int, int] | None = None,
                   engine_sleeps: bool = True, score_reference: bool = True,
                   score_teacher: bool = True, score_policy: bool = True, generate_only: bool = False) -> Rollouts:
    """The rollout factory of one process, of every torchrun rank and of every Ray rollout actor: an engine in this
    process, the experience maker (its actor is the trained policy, or a Ray actor's scoring copy), the prompt stream
    and the held-out evaluation (rank 0, or the first ``share``). ``share`` and ``engine_sleeps``: see
    :class:`~mmrlhf.trainer.rollouts.LocalSettings`; ``score_reference=False`` / ``score_teacher=False``: the maker
    holds no reference / distillation teacher (a Ray rollout actor whose trainer actors score it);
    ``score_policy=False``: nor a scoring copy of the policy (its actor has no weights; the trainers score it);
    ``generate_only=True``: the maker generates and rewards only (the trainer actors make the experiences:
    :func:`~mmrlhf.models.ray_placement.experiences_on_trainers`), holding no model but the engine."""
    from mmrlhf.data.stream import PromptStream
    from mmrlhf.experience.builder import build_experience_maker

    t, a, d = config.trainer, config.algorithm, config.data
    stack = build_experience_maker(config, critic=critic, before_engine=freeze, policy_path=policy_path,
                                   score_reference=score_reference,
                                   score_teacher=score_teacher, score_policy=score_policy,
                                   generate_only=generate_only)
    # torchrun ranks share an engine per rollout.tensor_parallel_size of them (mmrlhf.parallel.engine_groups)
    group_size = config.rollout.tensor_parallel_size if share is None and world.launch == "torchrun" else 1
    # the evaluation's engine calls are its group's: every rank of the first engine group evaluates alike
    first = world.rank < group_size if share is None else share[0] == 0
    evaluator = build_evaluator(config, stack.maker) if t.eval_steps and first else None
    settings = LocalSettings(
        rollout_batch_size=t.rollout_batch_size, dynamic_sampling=a.dynamic_sampling,
        dynamic_sampling_max_extra_rounds=a.dynamic_sampling_max_extra_rounds,
        dynamic_sampling_tol=a.dynamic_sampling_tol, engine_sleeps=engine_sleeps, share=share,
        reward_combination=a.reward_combination, reward_component_eps=a.advantage_eps,
        engine_group_size=group_size)
    stream = PromptStream(build_prompt_source(config), seed=t.seed, shuffle=d.shuffle,
                          restart_on_change=d.restart_stream_on_resume)
    scorers = tuple(m for m in (stack.reference, stack.teacher) if m is not None)
    return Rollouts(stack.actor, LocalRollouts(stack.maker, stream, world, settings, evaluator), stack.processor,
                    stack.tokenizer, scorers=scorers)


def build_trainer(config: MMRLHFConfig, *, resume: bool = False, world: World | None = None,
                  rollouts: RolloutFactory = local_rollouts) -> Trainer:
    """Models, rollout source, updaters, evaluation, tracker, checkpoints and reports of this rank of a run.

    ``world``: this rank among the training ranks (default: one process on ``trainer.device``). In a world of
    several ranks the actor and critic are sharded with FSDP2 and every rank samples with its own seed; only rank 0
    writes metrics, reports and the progress bar. ``rollouts``: where experiences come from (the launch mode's
    factory; default an engine in this process)."""
    from mmrlhf.devices import resolve_device
    from mmrlhf.trainer.tracking import MetricsTracker, SilentTracker, WandbSettings

    world = world or single(resolve_device(config.trainer.device))
    if world.device.type == "cpu":  # a GPU user is told which kernels to install; on the CPU there are none
        vllm_quiet.install_cpu_training()
    record = config.model_dump(mode="json")  # what the user configured (the ranks' seeds are derived from it)
    configured, config = config, _rank_config(config, world)
    check_before_models(config)  # what the config and the data tell, before the output folder or any model
    t = config.trainer
    out = Path(t.output_dir)
    checkpoints = CheckpointManager(out / "checkpoints", t.keep_last)
    resume_from = refused = None
    if world.is_main:  # rank 0 alone cleans the folder; the others learn its choice, or its refusal, and stop too
        try:
            resume_from = _prepare_output(out, checkpoints, resume=resume, overwrite=t.overwrite_output_dir,
                                          strict=t.resume_strict)
        except (OSError, ValueError) as exc:
            refused = exc
    resume_from, refused = world.broadcast_object((resume_from, refused))
    if refused is not None:
        raise refused
    if resume_from is not None:
        resume_from = Path(resume_from)
        check_resume_mode(resume_from, launch=world.launch, world_size=world.world_size)
    changes = _resume_changes(resume_from, record) if resume_from is not None else []
    seeds = RANK_SEEDS
    if resume_from is not None:
        config, seeds = resumed_rank_config(configured, config, world, resume_from)
    seed_everything(t.seed)

    def freeze(actor: Any) -> None:
        counts = freeze_vision(actor.model, actor.adapter, tower=t.freeze_vision_tower, merger=t.freeze_merger)
        logger.info("policy parameters: %d trainable, %d frozen", counts["trainable"], counts["frozen"])

    critic = build_critic(config) if config.algorithm.advantage_estimator == "gae" else None
    made = rollouts(config, world, critic, str(resume_from / "model") if resume_from else None, freeze)
    if t.gradient_checkpointing:  # after the freezing and LoRA (they decide which blocks), before any sharding
        for model in (made.actor, critic):
            if model is not None:
                blocks = checkpoint_blocks(model)
                logger.info("trainer.gradient_checkpointing: %s recomputes %d blocks in the backward",
                            type(model).__name__, len(blocks))
    if world.sharded or config.distributed.offload != "none":  # offload: FSDP2's, over a world of one rank too
        _check_group(config.distributed.offload)
        shard_models(made.actor, critic, compute_dtype=config.model.dtype, offload=config.distributed.offload,
                     scorers=made.scorers)
    policy, critic_updater = build_updaters(config, made.actor, critic, pad_id=made.tokenizer.pad_token_id,
                                            world=world)
    wandb = None
    if t.wandb_project:
        wandb = WandbSettings(project=t.wandb_project, entity=t.wandb_entity, run_name=t.wandb_run_name,
                              mode=t.wandb_mode)
    tracker: Any = SilentTracker()  # ranks > 0: rank 0 writes the run's metrics (already merged over ranks)
    if world.is_main:
        tracker = MetricsTracker(out, tensorboard=t.tensorboard, wandb=wandb, run_config=record,
                                 resume=resume_from is not None, overwrite=t.overwrite_output_dir)
    parts = TrainerParts(
        source=made.source, policy=policy, critic=critic_updater, tracker=tracker, checkpoints=checkpoints,
        reporter=StepReporter(out, made.tokenizer, groups=t.report_groups, title=out.name),
        processor=made.processor, shuffle=torch.Generator().manual_seed(t.seed), world=world)
    settings = LoopSettings(
        max_steps=t.max_steps, output_dir=str(out), save_steps=t.save_steps, log_steps=t.log_steps,
        eval_steps=t.eval_steps, report_steps=t.report_steps, progress_bar=t.progress_bar, config=record,
        rank_seeds=seeds)
    trainer = Trainer(parts, settings)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        kl = getattr(getattr(made.source, "maker", None), "kl_controller", None)
        lines = apply_changes(changes, policy_stepper=policy.stepper,
                              critic_stepper=None if critic_updater is None else critic_updater.stepper,
                              kl_controller=kl)
        if world.is_main:
            for line in lines:
                print(line, file=sys.stderr)
        logger.info("resumed from %s (step %d)", resume_from, trainer.state.step)
    loaded()  # the steps collect garbage as Python always does (mmrlhf.startup)
    return trainer


def _resume_changes(checkpoint: Path, record: dict[str, Any]) -> list:
    """The keys changed since ``checkpoint`` was written (refused ones raise, before any model loads)."""
    saved = read_trainer_state(checkpoint).get("config")
    if saved is None:
        logger.warning("%s records no config: changed keys cannot be checked", checkpoint)
        return []
    return check_changes(saved, record, str(checkpoint))


def compute_copy(model: torch.nn.Module, t: Any, name: str) -> ComputeCopy | None:
    """``trainer.compute_copy`` for ``model`` (an actor, or a critic's body): a copy where its forwards autocast
    (``compute_dtype`` set: float32 masters, bf16 compute; None under FSDP2's own casts) and the key asks for one."""
    dtype = getattr(model, "compute_dtype", None)
    wanted = t.compute_copy if t.compute_copy != "auto" else not t.gradient_checkpointing
    if dtype is None or not wanted:
        return None
    copies = ComputeCopy(model, dtype)
    if not copies.slots:
        return None
    logger.info("trainer.compute_copy: the %s's %d Linear tensors (%.2f GiB in %s) cast once per optimiser step",
                name, len(copies.slots), copies.nbytes / 2**30, str(dtype).removeprefix("torch."))
    return copies


def build_updaters(config: MMRLHFConfig, actor: Any, critic: Any | None, *, pad_id: int,
                   world: World) -> tuple[PolicyUpdater, CriticUpdater | None]:
    """The policy updater (and the critic's, when ``critic`` is given) with their optimisers and schedules; the
    training half of a run, shared by every launch mode. The models compute on their own devices (they move each
    batch there, :mod:`mmrlhf.models.placement`). ``world``: the training ranks (in a world of several the
    models are already sharded; the update loop normalises over all ranks)."""
    t, a = config.trainer, config.algorithm
    samples_per_step = t.rollout_batch_size * config.rollout.n_samples_per_prompt
    total_opt_steps = t.max_steps * t.ppo_epochs * math.ceil(samples_per_step / t.train_batch_size)

    def stepper(model: torch.nn.Module, lr: float, name: str, computes: torch.nn.Module) -> GuardedStepper:
        opt = build_optimizer(model.parameters(), lr=lr, weight_decay=t.weight_decay, betas=t.adam_betas,
                              eps=t.adam_eps)
        sched = build_scheduler(opt, schedule=t.lr_scheduler, warmup_steps=t.warmup_steps,
                                total_steps=total_opt_steps, min_ratio=t.min_lr_ratio)
        return GuardedStepper(list(model.parameters()), opt, sched, max_grad_norm=t.max_grad_norm,
                              max_consecutive=t.max_consecutive_nonfinite, name=name, world=world,
                              compute_copy=compute_copy(computes, t, name))

    # model.dtype is the compute dtype in every launch mode (autocast in one process, FSDP2's policy under torchrun)
    correction = resolve_rollout_correction(a, engine=config.rollout.engine, engine_dtype=_engine_dtype(config),
                                            train_dtype=config.model.dtype, device=module_device(actor))
    budget = update_token_budget(config)
    logger.info("rollout correction: %s; shared-prompt forward: %s; update micro-batches: %s", correction,
                "on" if _layout(config)["shared_prompt"] else "off",
                f"{t.micro_train_batch_size} samples" if budget is None else
                f"token budget {budget} (count {t.micro_train_batch_size})")
    policy = PolicyUpdater(actor, stepper(actor, t.lr, "policy", actor), policy_update_settings(config, correction),
                           pad_id=pad_id)
    if critic is None:
        return policy, None
    critic_updater = CriticUpdater(
        critic, stepper(critic, t.critic_lr, "critic", critic.body),  # the value head computes outside autocast
        CriticUpdateSettings(train_batch_size=t.train_batch_size, micro_batch_size=t.micro_train_batch_size,
                             ppo_epochs=t.ppo_epochs, value_clip=a.value_clip, value_loss_coef=a.value_loss_coef,
                             agg=a.loss_agg, norm_len=a.loss_agg_norm_len, packing=t.packing_samples,
                             max_tokens_per_micro_batch=budget, **_layout(config)),
        pad_id=pad_id, adapter=actor.adapter)
    return policy, critic_updater


def _check_group(offload: str) -> None:
    """FSDP2 needs a process group; one process gets its own from ``mmrlhf train`` (:mod:`mmrlhf.launch`)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(f"distributed.offload={offload} shards the models with FSDP2, which needs a process group: "
                         "train with `mmrlhf train` (it makes one for a single process), or pass build_trainer a "
                         "world from mmrlhf.parallel.world.join_alone")


def _rank_config(config: MMRLHFConfig, world: World, *, seeds: str = RANK_SEEDS) -> MMRLHFConfig:
    """What differs per rank, checked first: every rank samples with its own seed (:func:`rank_seed` of
    ``rollout.seed`` and the rank under the scheme ``seeds``: rank 0's is the one-process seed, the others' are
    mixed, so that no rank of seed s draws another rank's stream of seed s + 1). The step-wide statistics (advantage
    whitening, reward normalisation, the adaptive KL controller, dynamic sampling, high-entropy token selection) are
    collectives over the ranks, and LoRA adapters are sharded with the base (docs/distributed.md): every rank
    computes what one process computes."""
    t, r = config.trainer, config.rollout
    world.share(t.rollout_batch_size, "trainer.rollout_batch_size")
    world.share(t.train_batch_size, "trainer.train_batch_size")
    # ranks that share an engine (rollout.tensor_parallel_size under torchrun) sample with their group's seed
    index = group_seed_index(world.rank, world.world_size, r.tensor_parallel_size if world.launch == "torchrun" else 1)
    if r.seed is None or not index:
        return config
    return config.model_copy(update={"rollout": r.model_copy(update={"seed": rank_seed(r.seed, index, seeds)})})


def resumed_rank_config(configured: MMRLHFConfig, config: MMRLHFConfig, world: World,
                        checkpoint: Path) -> tuple[MMRLHFConfig, str]:
    """This rank's config (``config``, derived from ``configured`` by :func:`_rank_config`) and rank-seed scheme for a
    run resumed from ``checkpoint``: the scheme the checkpoint records, so that every rank's sampling goes on as it
    began. One written before the mixed seeds records none: the run keeps ``rollout.seed + rank`` to its end (and its
    next checkpoints say so), with one warning where that differs from the mixed seeds (torchrun ranks > 0; the Ray
    rollout actors are told by their source, :class:`~mmrlhf.launch.ray.source.RayRollouts`)."""
    seeds = rank_seeds_of(checkpoint)
    if seeds == RANK_SEEDS:
        return config, seeds
    if world.is_main and world.world_size > 1 and world.launch != "ray" and configured.rollout.seed is not None:
        logger.warning("%s was written before the ranks' sampling seeds were mixed: this run keeps rollout.seed + rank "
                       "to its end, so that its ranks' streams go on as they began (a new run mixes them)", checkpoint)
    return _rank_config(configured, world, seeds=seeds), seeds


def build_prompt_source(config: MMRLHFConfig) -> Any:
    """The training prompts: files (``data.prompt_data``) or a generator (``data.generator``)."""
    from mmrlhf.data.datasets import PromptDataset
    from mmrlhf.data.stream import GeneratedPrompts

    d = config.data
    if d.prompt_data:
        return PromptDataset(d.prompt_data, d)
    if d.generator:
        return GeneratedPrompts(d.generator, d, split="train", options=d.generator_options)
    raise ValueError("no prompts: set data.prompt_data (files) or data.generator (prompts made on the fly)")


def build_evaluator(config: MMRLHFConfig, maker: Any) -> Any:
    """Held-out evaluation through ``maker`` (``data.eval_data``, or the generator's eval split)."""
    from mmrlhf.data.datasets import PromptDataset
    from mmrlhf.data.stream import GeneratedPrompts
    from mmrlhf.trainer.evaluation import Evaluator

    d, t = config.data, config.trainer
    if d.eval_data:
        eval_records = list(PromptDataset(d.eval_data, d))[: d.eval_size]
    elif d.generator:
        gen = GeneratedPrompts(d.generator, d, split="eval", options=d.generator_options)
        eval_records = [gen[i] for i in range(d.eval_size)]
    else:
        raise ValueError("trainer.eval_steps > 0 needs held-out prompts: data.eval_data or data.generator")
    return Evaluator(maker, eval_records, greedy=t.eval_greedy, n_samples=t.eval_samples_per_prompt,
                     seed=config.rollout.seed)


def build_critic(config: MMRLHFConfig) -> Any:
    """A CriticVL on the configured device (vision tower frozen like the policy's; the actor's precision rule). Under
    ``rollout.routing_replay=replay`` its body replays the engine's expert choice as the actor's does: the values are
    then of the states the engine's routing produced."""
    from mmrlhf.devices import resolve_device
    from mmrlhf.experience.builder import load_model
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.models.critic import CriticVL

    m, t = config.model, config.trainer
    adapter = get_adapter(m.pretrain, m.family)
    body = load_model(m, m.critic or m.pretrain, adapter, trainable=True,  # float32 master, like the actor
                      routing_replay=config.rollout.routing_replay)
    freeze_vision(body.model, adapter, tower=t.freeze_vision_tower, merger=t.freeze_merger)
    return CriticVL(body).to(resolve_device(t.device))
