"""A trainer actor of the Ray mode: one rank of the one training loop. ``distributed.num_trainer_actors`` of them
form one torch process group (gloo on the CPU, NCCL on GPUs) and shard the policy and critic with the same FSDP2
plan as torchrun ranks; their experiences come from the rollout actors (:class:`~mmrlhf.launch.ray.source.
RayRollouts`), the rest is :class:`~mmrlhf.trainer.loop.Trainer` as in one process."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import socket
from typing import Any, Callable

import torch

from mmrlhf.launch.ray.source import RayRollouts, RaySettings
from mmrlhf.models.ray_placement import (experiences_on_trainers, policy_on_trainers, reference_on_trainers,
                                         teacher_on_trainers)

logger = logging.getLogger(__name__)

TRAINER_NAME = "mmrlhf-trainer"


def trainer_name(index: int) -> str:
    return f"{TRAINER_NAME}-{index}"


def ray_rollouts(config: Any, world: Any, critic: Any, policy_path: str | None, freeze: Callable[[Any], None], *,
                 pool: Any, push_weights: bool) -> Any:
    """The rollout factory of a trainer rank (:data:`~mmrlhf.trainer.builder.RolloutFactory`): the policy built on
    this rank's device (no engine here), the rollout actors as the source; and the reference and the distillation
    teacher where the trainer actors score them (:func:`~mmrlhf.models.ray_placement.reference_on_trainers`,
    :func:`~mmrlhf.models.ray_placement.teacher_on_trainers`: the builder shards them with the policy). Where the
    trainers make the experiences (:func:`~mmrlhf.models.ray_placement.experiences_on_trainers`) an experience maker
    without an engine, holding this rank's policy, critic, reference and teacher
    (:func:`~mmrlhf.experience.builder.build_scoring_maker`), makes the experiences of the rows the rollout actors
    send."""
    from transformers import AutoProcessor

    from mmrlhf.devices import resolve_device
    from mmrlhf.experience.builder import build_policy, policy_sampling
    from mmrlhf.rollout.base import forbidden_token_ids
    from mmrlhf.trainer.builder import Rollouts

    m, t, d = config.model, config.trainer, config.distributed
    # with LoRA the adapters train here, and only they travel to the rollout actors (kind "lora")
    actor, _ = build_policy(config, policy_path, device=resolve_device(t.device), before_adapters=freeze)
    processor = AutoProcessor.from_pretrained(m.pretrain, trust_remote_code=m.trust_remote_code)
    # Score the distribution the engine samples from (a rollout actor's maker does the same to its actor copy).
    actor.excluded_token_ids = forbidden_token_ids(actor.adapter, policy_sampling(config, processor.tokenizer,
                                                                                  actor.model))
    rows = experiences_on_trainers(config)
    # a LoRA policy's adapters travel alone to a rollout actor's policy copy; without one (rows, a vLLM engine) the
    # engine's layers are merged here
    merged = rows and bool(m.lora.rank) and config.rollout.engine == "vllm"
    maker, scorers = None, ()
    if rows:
        from mmrlhf.experience.builder import build_scoring_maker

        stack = build_scoring_maker(config, actor, processor.tokenizer, critic=critic,
                                    device=resolve_device(t.device))
        maker, scorers = stack.maker, tuple(x for x in (stack.reference, stack.teacher) if x is not None)
    reference = None
    if reference_on_trainers(config):  # the KL loss's reference: sharded with the policy (mmrlhf.experience.rescoring)
        from mmrlhf.experience.builder import load_model

        reference = load_model(m, m.reference or m.pretrain, actor.adapter, trainable=False,
                               routing_replay=config.rollout.routing_replay).to(resolve_device(t.device)).eval()
        reference.requires_grad_(False)
        reference.excluded_token_ids = actor.excluded_token_ids
    teacher = None
    if teacher_on_trainers(config):  # the distillation loss term's teacher: sharded with the policy too
        from mmrlhf.experience.builder import build_teacher

        teacher = build_teacher(config, actor.adapter, resolve_device(t.device))
        teacher.excluded_token_ids = actor.excluded_token_ids
    settings = RaySettings(max_steps=t.max_steps, max_staleness=d.max_staleness,
                           on_rollout_failure=d.on_rollout_failure, max_actor_restarts=d.max_actor_restarts,
                           bucket_bytes=config.rollout.weight_sync_bucket_mb * 2**20,
                           weight_kind="lora" if m.lora.rank and not merged else "full", push_weights=push_weights,
                           scoring_micro_batch_size=config.rollout.micro_rollout_batch_size,
                           scoring_max_tokens=config.rollout.max_tokens_per_micro_batch,
                           report_steps=t.report_steps, sequential=config.algorithm.dynamic_sampling,
                           kl_estimator=config.algorithm.kl_estimator, distill_topk=config.algorithm.distill_topk,
                           old_policy=policy_on_trainers(config), rows=rows)
    source = RayRollouts(pool, world, settings, reference=reference, teacher=teacher, maker=maker,
                         merged_lora=merged)
    return Rollouts(actor, source, processor, processor.tokenizer,
                    scorers=scorers + tuple(model for model in (reference, teacher) if model is not None))


class RayTrainerRank:
    """Trainer rank ``rank`` of ``world_size`` (wrapped with ``ray.remote`` by the driver, two threads: the driver
    asks for progress and passes a stop request while :meth:`fit` runs). ``push_weights=False`` announces new
    versions to the rollout actors without sending any tensor: the control run of the sync check, never a user
    setting."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int, threads: int, pool: Any, *,
                 push_weights: bool = True) -> None:
        from mmrlhf.config import build_config
        from mmrlhf.startup import defer_full_collections

        defer_full_collections()  # until setup() built the trainer (mmrlhf.startup)
        torch.set_num_threads(threads)
        self.config = build_config(config)
        self.rank, self.world_size, self.pool, self.push_weights = rank, world_size, pool, push_weights
        self.trainer: Any = None

    def address(self) -> str:
        """A rendezvous address on this actor's node (rank 0's), for the ranks' process group."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, resume: bool, init_method: str) -> str | None:
        """Join the ranks' process group and build this rank's trainer; an error line, or None."""
        from mmrlhf.config import dump_config
        from mmrlhf.parallel.world import join
        from mmrlhf.trainer.builder import build_trainer

        world = join(self.rank, self.world_size, 0, launch="ray", init_method=init_method,
                     process_group=self.config.distributed.process_group,
                     host_tensors=self.config.distributed.offload != "none")
        factory = functools.partial(ray_rollouts, pool=self.pool, push_weights=self.push_weights)
        try:
            self.trainer = build_trainer(self.config, resume=resume, world=world, rollouts=factory)
        except (OSError, ValueError) as exc:  # the config, the output folder, the checkpoint, the model files
            return f"error ({trainer_name(self.rank)}): {exc}"
        if world.is_main:
            with open(f"{self.trainer.s.output_dir}/config.yaml", "w") as f:
                f.write(dump_config(self.config))
        return None

    def fit(self) -> dict[str, Any]:
        """Train (the one loop); exit code, last metrics, the step reached, and what was printed (the driver shows
        it: the interruption's and the errors' lines)."""
        from mmrlhf.launch.report import fit_or_report

        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code, metrics = fit_or_report(self.trainer, f" ({trainer_name(self.rank)})")
        t = self.trainer
        out = {"code": code, "metrics": metrics, "step": t.state.step, "stdout": stdout.getvalue(),
               "stderr": stderr.getvalue(),
               "interrupted": bool(getattr(t, "interrupted", False)), "checkpoint": None, "summary": {}}
        if t.main:
            latest = t.p.checkpoints.latest()
            out["checkpoint"] = None if latest is None else str(latest)
            out["summary"] = t.p.source.summary()
        return out

    def request_stop(self) -> None:
        """Stop after the step in progress (the driver's Ctrl-C / SIGTERM); every rank agrees at the step's end."""
        if self.trainer is not None:
            self.trainer.stop_requested = True

    def progress(self) -> int:
        """Steps finished so far."""
        return 0 if self.trainer is None else self.trainer.state.step

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The trainable policy tensors, full (tests compare them with a rollout actor's copy and other runs'). Every
        rank must call it when the policy is sharded."""
        from mmrlhf.rollout.weight_sync import policy_weights

        return {n: t.detach().cpu().clone() for n, t in policy_weights(self.trainer.p.policy.actor.model)}
