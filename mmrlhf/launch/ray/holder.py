"""``ExperienceMakerHolder``: a rollout actor. It holds the producer every launch mode uses
(:class:`~mmrlhf.trainer.rollouts.LocalRollouts`, made by the same factory: engine, scoring copy of the policy,
reference, critic copy, reward engine, prompt stream), positions its stream and seeds its maker for the step it is
asked for, and returns that producer's step batch for its share of the step's prompts (train items, CPU tensors, with
their metrics and scoring distribution) through Ray's object store; trainers push new weights back with
:meth:`update_experience_maker`.

Why a lock: the actor runs with two threads so that weight chunks can be received while a batch is generated, but
the weights it generates and scores with change only between batches: chunks are staged, and the last one applies
the whole update (engine, scoring actor copy and critic copy together, then the version bump) under the same lock a
generation holds from its first prompt to its last experience.

Partial rollouts (``rollout.partial``): the engine generates in segments (:mod:`mmrlhf.rollout.partial`) and this
actor is the segments' version gate. An update whose last chunk arrives during a generation is queued; the
generating thread applies it at the next segment boundary (the unfinished answers continue under it), so the
trainer's push waits for one segment, not for the batch's longest answer. Every token records its version, and the
metadata records the version of every segment of every engine call (``segment_versions``): a resume regenerates an
in-flight batch with the same versions at the same boundaries (``generate(..., replay=...)``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from mmrlhf.rollout.types import rank_seed

logger = logging.getLogger(__name__)

HOLDER_NAME = "ExperienceMakerHolder"
# "full": the policy's trainable tensors; "lora": only its LoRA adapter tensors (A, B), which the rollout actor's own
# adapted copy takes, and the engine then gets through the one-process sync (merged weights or vLLM's LoRA).
WEIGHT_KINDS = ("full", "lora")


def holder_name(index: int) -> str:
    """The Ray actor name of rollout actor ``index``."""
    return f"{HOLDER_NAME}-{index}"


def running_state(maker_state: dict[str, Any]) -> dict[str, Any]:
    """The part of a maker's state that runs from step to step (the KL controller, the reward normaliser): its
    sampling call count is not, as a rollout actor sets it per step."""
    return {k: v for k, v in maker_state.items() if k != "calls"}


class ExperienceMakerHolder:
    """Rollout actor ``index`` of ``count`` (wrapped with ``ray.remote`` by the driver).

    Args:
        config: the run's config as a dict (``model_dump``); rebuilt and validated here.
        index, count: this actor's place among the rollout actors (its share of every step's prompts).
        threads: torch threads (the actor's CPU reservation).
        exchange: with several rollout actors, the run's :class:`~mmrlhf.launch.ray.exchange.StepExchange`: a
            step's shaping statistics, running state and dynamic sampling's choice are the whole step's, taken over
            every actor's share as torchrun ranks take them (:class:`~mmrlhf.launch.ray.exchange.SharesWorld`).
    """

    def __init__(self, config: dict[str, Any], index: int, count: int, threads: int, exchange: Any = None) -> None:
        from mmrlhf.startup import defer_full_collections, loaded

        defer_full_collections()  # until the engine and the models are built (mmrlhf.startup)
        from mmrlhf.config import build_config
        from mmrlhf.devices import resolve_device
        from mmrlhf.models.ray_placement import (experiences_on_trainers, policy_on_trainers, reference_on_trainers,
                                                 teacher_on_trainers)
        from mmrlhf.parallel.world import single
        from mmrlhf.trainer.builder import build_critic, local_rollouts
        from mmrlhf.trainer.optim import freeze_vision
        from mmrlhf.trainer.preflight import check_before_models
        from mmrlhf.trainer.state import seed_everything

        torch.set_num_threads(threads)
        cfg = build_config(config)
        r = cfg.rollout
        self._run_seed = r.seed
        if cfg.algorithm.dynamic_sampling and index and r.seed is not None:
            # its sampling calls run on from step to step as every actor's do (rather than being set per step and
            # actor): its own seed, as each torchrun rank has, so the actors' samples are not alike
            cfg = cfg.model_copy(update={"rollout": r.model_copy(update={"seed": rank_seed(r.seed, index)})})
        self.config = cfg
        self.index, self.count = index, count
        t = cfg.trainer
        check_before_models(cfg)  # refused by the config or the data: before its engine and models load
        seed_everything(t.seed)
        # where the trainers make the experiences (experiences_on_trainers) this actor generates and rewards, and
        # sends the step's rows (no scoring copy, reference, teacher or critic here)
        self.rows = experiences_on_trainers(cfg)
        critic = build_critic(cfg) if cfg.algorithm.advantage_estimator == "gae" and not self.rows else None
        if critic is not None:
            critic.requires_grad_(False)

        def freeze(actor: Any) -> None:
            freeze_vision(actor.model, actor.adapter, tower=t.freeze_vision_tower, merger=t.freeze_merger)

        # One share of every step (whole prompts: GRPO groups never straddle two actors); the engine never sleeps
        # (weights arrive by push). Built in a world of its own (its models are whole); with several actors each
        # step's collectives then run over every share (``_world``).
        self._alone = single(resolve_device(t.device))
        made = local_rollouts(cfg, self._alone, critic, None, freeze, share=(index, count), engine_sleeps=False,
                              score_reference=not reference_on_trainers(cfg),  # else the trainer actors score them
                              score_teacher=not teacher_on_trainers(cfg),
                              score_policy=not policy_on_trainers(cfg),  # else no scoring copy of the policy
                              generate_only=self.rows)
        self.producer, self.actor, self.tokenizer = made.source, made.actor, made.tokenizer
        self.maker, self.stream, self.evaluator = self.producer.maker, self.producer.stream, self.producer.evaluator
        # the models it scores with beside its engine (a policy copy, reference, teacher, critic): 0 where its
        # trainer actors score everything (ray/rollout_scoring_models)
        m = self.maker
        self.scoring_models = int(m.settings.score_policy and cfg.rollout.engine == "vllm") + sum(
            x is not None for x in (m.initial_model, m.teacher_model, m.critic))
        self.version = 0
        self._lock = threading.Lock()  # held by a generation and by the application of an update
        self.exchange = exchange if count > 1 else None
        # algorithm.dynamic_sampling: a step reads as many prompts (and sampling calls) as its rounds need, so the
        # stream and the call count run on from one step to the next, as in one process; ``_positions``: step ->
        # (stream, maker state) where it begins
        self.sequential = cfg.algorithm.dynamic_sampling
        # The steps are generated in order (``_turn``, from ``_next_step``; a resume or a restart says where they
        # start: ``expect``) when the stream reads on, when the maker carries a running state from step to step
        # (reward normalisation, the adaptive KL coefficient: with ``max_staleness`` >= 1 two steps are asked at
        # once, and the second could otherwise take the lock first and be shaped with the state before the first),
        # and when the actors meet inside each step (an actor busy with step t + 1 would leave the others waiting
        # in step t)
        a = cfg.algorithm
        running = a.reward_normalization or a.kl_controller == "adaptive"
        self.ordered = self.sequential or running or self.exchange is not None
        self._turn = threading.Condition(self._lock)
        self._next_step = 0
        self._positions: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {
            0: (self.stream.state_dict(), self.maker.state_dict())}
        self._stage_lock = threading.Lock()
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._staged_version: int | None = None
        self._last_end: float | None = None
        # rollout.partial: updates waiting for a segment boundary (named tensors, kind, version, applied event), the
        # segment versions of this generation's engine calls, and a checkpoint's plan while replaying one
        self.partial = cfg.rollout.partial
        self._pending: list[tuple[list[tuple[str, torch.Tensor]], str, int, threading.Event, list[str]]] = []
        self._generating = False
        self._replay: dict[str, Any] | None = None
        if self.partial:
            from mmrlhf.rollout.partial import SegmentedEngine

            self.maker.engine = SegmentedEngine(self.producer.engine, cfg.rollout.partial_segment_tokens, self)
            agent = getattr(self.maker.kind, "loop", None)  # multi-turn: every turn generated in segments too
            if agent is not None:
                agent.use_segmented(self.maker.engine)
        loaded()

    # ---- rollout ---------------------------------------------------------------------------------------------------
    def generate(self, step: int, min_version: int, replay: dict[str, Any] | None = None, *, report: bool = False
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The train items of this actor's share of ``step``'s prompts, generated with policy version >=
        ``min_version`` (the staleness gate; the driver only asks once that version was pushed). Two objects (called
        with ``num_returns=2``): the small metadata the driver reads, and the same plus the items, which only the
        trainer reads. ``replay`` (``rollout.partial``, a resume): ``{"segments": [[version per segment] per engine
        call], "weights": {version: named tensors}, "kind": weight kind}``, the versions a checkpoint recorded for
        this batch, applied at the same boundaries instead of the updates that arrive. ``report`` (a report step,
        asked of one actor): the payload also carries what the trainer's step report shows of this share
        (``report``: the first ``trainer.report_groups`` groups as plain report samples, images shrunk to the page's
        size), since the rollout itself (rows, trajectories, judge notes) stays here."""
        from mmrlhf.experience.wire import pack_items
        from mmrlhf.launch.ray.ledger import StaleExperienceError

        with self._lock:
            while self.ordered and step != self._next_step:  # its turn (see ``ordered``)
                if step < self._next_step:
                    raise RuntimeError(f"{holder_name(self.index)}: step {step} asked again after step "
                                       f"{self._next_step - 1} (the steps are generated in order)")
                self._turn.wait()
            start = time.perf_counter()
            waited = 0.0 if self._last_end is None else start - self._last_end
            if self.version < min_version:
                raise StaleExperienceError(f"{holder_name(self.index)}: asked for step {step} with version >= "
                                           f"{min_version} while holding version {self.version}")
            version = self.version
            # Positioned by step (every actor reads the same stream and keeps its share), and sampling seeds that
            # follow (step, actor), not this process's call count: a restarted actor regenerates a lost batch with
            # the same prompts and seeds. Dynamic sampling reads on where the last step stopped instead.
            if not self.sequential:
                self._seek(step)
                self.maker.load_state_dict({"calls": step * self.count + self.index})
            segments: list[list[int]] = []
            if self.partial:
                self.maker.engine.calls = segments
                self._generating, self._replay = True, replay
            self.producer.world = self._world(step)
            try:
                if self.rows:  # the trainer actors make the experiences: the rows they train, rewarded
                    batch = self._rows(step)
                else:
                    batch = self.producer.collect(step)  # CPU tensors whatever the models' device
            finally:
                self._generating, self._replay = False, None
                self.producer.world = self._alone
            if batch.rollout is None and batch.items:  # dynamic sampling kept no group of this share: the
                batch.items.clear()  # inert sample that paired its forwards with the other shares' trains nothing
            self._last_end = time.perf_counter()
            # read under the lock: another call (the next step's generate, a checkpoint's stream_state) moves them
            maker_state, stream_state = self.maker.state_dict(), self.stream.state_dict()
            if self.sequential:
                self._positions[step + 1] = (self.stream.state_dict(), maker_state)
                for old in [k for k in self._positions if k < step - 16]:  # a checkpoint asks for recent steps only
                    del self._positions[old]
            if self.ordered:
                self._next_step = step + 1
                self._turn.notify_all()
            if segments:  # the oldest token's version: what the staleness bound reads
                version = min(v for call in segments for v in call)
        rows = batch.rollout if self.rows else None
        meta = {"step": step, "share": self.index, "version": version,
                "samples": len(rows) if rows is not None else len(batch.items),
                "segment_versions": segments,
                "stream": stream_state,  # after this step's prompts (what a checkpoint records)
                # the maker's running statistics after this step's shaping (reward normalisation, adaptive KL), and
                # with dynamic sampling its call count (where the next step's sampling seeds go on)
                "maker": maker_state if self.sequential else running_state(maker_state),
                "distribution": batch.distribution, "metrics": batch.metrics, "rollout_wait_s": waited,
                "generate_s": self._last_end - start, "scoring_models": self.scoring_models}
        if self.rows:  # (the trainer's rank 0 reports from the rows it is dealt)
            return meta, {**meta, "rows": rows, "report": None}
        shown = None
        if report and batch.rollout is not None:
            from mmrlhf.trainer.reporting import compact, report_samples

            shown = compact(report_samples(batch.rollout, batch.items, self.tokenizer,
                                           self.config.trainer.report_groups))
        # columnar: one flat tensor per field (pickling each item's tensors one by one cost more than generating)
        return meta, {**meta, "items": pack_items(batch.items), "report": shown}

    def _rows(self, step: int) -> Any:
        """Where the trainers make the experiences (``experiences_on_trainers``): this share's rows of step
        ``step``, generated and rewarded (dynamic sampling's kept groups), as a step batch without items
        (``rollout``: None where this share trains nothing: dynamic sampling kept none of its groups, or its every
        prompt was skipped)."""
        from mmrlhf.trainer.rollouts import StepBatch

        rollout, metrics, trains = self.producer.sample_step(step)
        if rollout is not None:  # generation's phases (the trainer actors add the experience's)
            metrics.update({f"time/{k}": v for k, v in rollout.seconds.items()})
            metrics["time/total"] = sum(rollout.seconds.values())
        kept = rollout if rollout is not None and trains else None
        return StepBatch([], metrics, kept.distribution if kept is not None else None, rollout=kept)

    def _world(self, step: int) -> Any:
        """The world of step ``step``'s collectives: every rollout actor's share (several actors), or this one."""
        if self.exchange is None:
            return self._alone
        from mmrlhf.launch.ray.exchange import RayExchange, SharesWorld

        return SharesWorld(rank=self.index, world_size=self.count, device=self._alone.device, launch="ray",
                           exchange=RayExchange(self.exchange), step=step)

    def expect(self, step: int) -> None:
        """The next step this actor is asked for is ``step`` (a resume's first, or a restarted actor's first lost
        one): the in-order generation starts there."""
        with self._lock:
            self._next_step = int(step)
            self._turn.notify_all()

    def _seek(self, step: int) -> None:
        """The stream where step ``step``'s prompts begin."""
        first = step * self.config.trainer.rollout_batch_size
        if self.stream.size is None:
            state = {"epoch": 0, "position": first}
        else:
            state = {"epoch": first // self.stream.size, "position": first % self.stream.size}
        self.stream.load_state_dict({**state, "seed": self.stream.seed})

    def stream_state(self, step: int) -> dict[str, Any]:
        """The prompt stream's state once ``step`` steps' prompts were read (what a checkpoint records)."""
        with self._lock:
            if self.sequential:
                if step not in self._positions:
                    raise RuntimeError(f"{holder_name(self.index)}: where step {step} begins is not known "
                                       "(algorithm.dynamic_sampling reads the stream on from step to step)")
                return self._positions[step][0]
            self._seek(step)
            return self.stream.state_dict()

    def load_position(self, step: int, stream: dict[str, Any], maker: dict[str, Any],
                      rank_seeds: str = "mixed") -> None:
        """Dynamic sampling, a resume: step ``step`` begins where the checkpoint's stream and maker (call count,
        running statistics) stood, and this actor samples with its seed under the run's scheme ``rank_seeds``
        (:func:`~mmrlhf.rollout.types.rank_seed`: a run resumed from a checkpoint written before the mixed seeds
        keeps ``offset``)."""
        with self._lock:
            self.stream.load_state_dict(stream)
            self.maker.load_state_dict(maker)
            if self._run_seed is not None:
                seed = rank_seed(self._run_seed, self.index, rank_seeds)
                self.maker.sampling = dataclasses.replace(self.maker.sampling, seed=seed)
            self._next_step = step
            self._positions[step] = (self.stream.state_dict(), self.maker.state_dict())

    def load_running_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's running statistics (:func:`running_state`), before this actor generates again."""
        with self._lock:
            self.maker.load_state_dict(running_state(state))

    def stream_index(self, state: dict[str, Any]) -> int:
        """The prompt index a stream state points at, counted from the first epoch's start."""
        return int(state["epoch"]) * (self.stream.size or 0) + int(state["position"])

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation with the current weights (rollout actor 0 only)."""
        if self.evaluator is None:
            raise RuntimeError(f"{holder_name(self.index)} has no evaluator (trainer.eval_steps=0 or not actor 0)")
        with self._lock:
            return self.evaluator.run()

    # ---- weights ---------------------------------------------------------------------------------------------------
    def update_experience_maker(self, chunk: list[tuple[str, torch.Tensor]], *, version: int, last: bool,
                                kind: str = "full") -> int | None:
        """Receive one chunk of the policy version ``version`` (names prefixed ``policy.`` / ``critic.``, tensors in
        transformers naming); the ``last`` chunk applies the whole update atomically and returns the new version.

        ``kind="full"``: the tensors replace the current trainable ones; ``kind="lora"``: they are the adapter tensors
        of a LoRA policy (the rollout actor's copy carries the same adapters). Either way the engine is then synced
        from the updated copy exactly as in one process (:func:`~mmrlhf.rollout.weight_sync.sync_weights`: the
        tensors themselves, or for LoRA the merged layers / the adapter loaded into vLLM)."""
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"update_experience_maker: unknown weight kind {kind!r}; supported: {WEIGHT_KINDS}")
        with self._stage_lock:
            if self._staged_version not in (None, version):
                raise RuntimeError(f"{holder_name(self.index)}: chunks of versions {self._staged_version} and "
                                   f"{version} interleaved")
            self._staged_version = version
            self._staged.extend(chunk)
            if not last:
                return None
            staged, self._staged, self._staged_version = self._staged, [], None
        if not self.partial:
            with self._lock:
                self._apply(staged, kind)
                self.version = version
            return version
        # A generation in progress applies it at its next segment boundary; with none, this thread takes the lock.
        applied, errors = threading.Event(), []
        with self._stage_lock:
            self._pending.append((staged, kind, version, applied, errors))
        while not applied.wait(0.005):
            if self._lock.acquire(blocking=False):
                try:
                    self._apply_pending()
                finally:
                    self._lock.release()
        if errors:
            raise RuntimeError(f"{holder_name(self.index)}: policy version {version} was not applied: {errors[0]}")
        return version

    # ---- partial rollouts: the segments' version gate ----------------------------------------------------------
    def boundary(self, call: int, segment: int) -> int:
        """Before segment ``segment`` of engine call ``call`` (the generating thread, under the lock): the queued
        updates applied, or while replaying a checkpoint the version it recorded there; the version it runs under."""
        if self._generating and self._replay is not None:
            want = int(self._replay["segments"][call][segment])
            if want != self.version:
                if want not in self._replay["weights"]:
                    raise RuntimeError(f"{holder_name(self.index)}: the checkpoint's plan needs policy version {want} "
                                       f"at call {call} segment {segment}, and its tensors were not given")
                self._apply(list(self._replay["weights"][want]), self._replay["kind"])
                self.version = want
        elif self._generating:
            self._apply_pending()
        return self.version

    def _apply_pending(self) -> None:
        """Every queued update, in order (called under the lock); each sender is released, with the error that
        stopped its update if one did (then the later ones are not applied either, and the error propagates)."""
        with self._stage_lock:
            queued, self._pending = self._pending, []
        failed: Exception | None = None
        for named, kind, version, applied, errors in queued:
            if failed is None:
                try:
                    self._apply(named, kind)
                    self.version = version
                except Exception as exc:  # noqa: BLE001 (told to every waiting sender, then raised here)
                    failed = exc
            if failed is not None:
                errors.append(f"{type(failed).__name__}: {failed}")
            applied.set()
        if failed is not None:
            raise failed

    def _apply(self, named: list[tuple[str, torch.Tensor]], kind: str) -> None:
        """Engine, scoring actor copy and critic copy from one set of tensors (called under the lock); without a
        scoring copy (its trainers score the policy) the tensors go straight into the engine."""
        policy = [(n[len("policy."):], t) for n, t in named if n.startswith("policy.")]
        critic = [(n[len("critic."):], t) for n, t in named if n.startswith("critic.")]
        other = [n for n, _ in named if not n.startswith(("policy.", "critic."))]
        if other:
            raise ValueError(f"update_experience_maker: tensors outside policy./critic.: {other[:5]}")
        if critic and self.maker.critic is None:
            raise ValueError("update_experience_maker: critic tensors sent to a rollout actor without a critic")
        if self.rows and kind == "lora" and self.config.rollout.engine == "vllm":
            raise ValueError("update_experience_maker: LoRA adapters sent to a rollout actor without a policy copy "
                             "(distributed.scoring: trainer sends merged layers)")
        from mmrlhf.models.lora import lora_model
        from mmrlhf.rollout.weight_sync import sync_weights

        if (kind == "lora") != (lora_model(self.actor.model) is not None):
            raise ValueError(f"update_experience_maker: {kind!r} weights for a rollout actor whose policy "
                             f"{'has' if kind != 'lora' else 'has no'} LoRA adapters (model.lora differs)")
        if not self.maker.settings.score_policy:  # no scoring copy (its trainers score the policy): the engine only
            if policy:
                self.producer.engine.update_weights(iter(policy))
            return
        with torch.no_grad():
            _copy_into(self.actor.model, policy, "policy")
            if critic:
                _copy_into(self.maker.critic, critic, "critic")
        if policy:
            sync_weights(self.actor.model, self.producer.engine)

    def state(self) -> dict[str, Any]:
        """Version and identity (the driver's health check), the next step it generates in order and its maker's
        running statistics (every actor holds the same)."""
        with self._lock:
            return {"name": holder_name(self.index), "version": self.version, "next_step": self._next_step,
                    "running": running_state(self.maker.state_dict())}

    def scoring_weights(self) -> dict[str, torch.Tensor]:
        """The scoring actor copy's trainable tensors (tests compare them with the trainer's); none where it holds
        no copy (its trainers score the policy)."""
        if not self.maker.settings.score_policy:
            return {}
        return {n: p.detach().clone() for n, p in self.actor.model.named_parameters() if p.requires_grad}


def _copy_into(module: torch.nn.Module, named: list[tuple[str, torch.Tensor]], what: str) -> None:
    params = dict(module.named_parameters())
    missing = [n for n, _ in named if n not in params]
    if missing:
        raise ValueError(f"update_experience_maker: the {what} copy has no parameter(s) {missing[:5]}")
    for name, tensor in named:
        params[name].copy_(tensor.to(params[name].device, params[name].dtype))
