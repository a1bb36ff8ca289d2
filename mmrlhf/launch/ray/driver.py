"""``mmrlhf train CONFIG distributed.backend=ray``: start (or join) Ray, place the rollout actors and the trainer
actor, and drive the steps under the staleness bound, counting every experience in and out.

The driver moves object references, never experiences: a rollout actor's experiences go from its process into the
object store and from there straight to the trainer actor. Step ``t``: the rollout of every step ``s <= t + k`` has
been asked for (``k`` = ``distributed.max_staleness``; the rollout actors already hold version ``t >= s - k``), the
driver waits for step ``t``'s shares, the trainer trains on them and pushes version ``t + 1``. With ``k = 0`` the
rollout of ``t + 1`` starts after that push (synchronous); with ``k >= 1`` it runs while the trainer trains on ``t``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from mmrlhf.launch.ray.holder import ExperienceMakerHolder, holder_name
from mmrlhf.experience.rollout import merge_share_metrics
from mmrlhf.trainer.interrupt import stop_on_interrupt
from mmrlhf.launch.ray.ledger import ExperienceLedger, StalenessStats, min_rollout_version
from mmrlhf.launch.ray.runtime import (
    PlacementPlan,
    actor_options,
    actor_threads,
    connect,
    describe_actor_error,
    plan_placement,
)
from mmrlhf.launch.ray.trainer_actor import RayPolicyTrainer, trainer_name

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 600.0  # how long the actors' placement group may wait for the cluster's resources


class RolloutActorFailure(RuntimeError):
    """A rollout actor died and the run may not (or can no longer) restart it."""


def check_ray_config(config: Any) -> None:
    """What the Ray mode does not support yet: refused by key, before anything starts."""
    d, t, a = config.distributed, config.trainer, config.algorithm
    if d.num_trainer_actors != 1:
        raise ValueError(f"distributed.num_trainer_actors={d.num_trainer_actors}: the Ray mode trains with one "
                         "trainer actor for now (a torch.distributed group across trainer actors is not built); "
                         "set distributed.num_trainer_actors=1, or use torchrun for data-parallel training")
    if a.dynamic_sampling:
        raise ValueError("algorithm.dynamic_sampling is not supported with distributed.backend=ray (the rollout "
                         "actors generate fixed batches); set algorithm.dynamic_sampling=false")
    if t.rollout_batch_size < d.num_rollout_actors:
        raise ValueError(f"trainer.rollout_batch_size={t.rollout_batch_size} < distributed.num_rollout_actors="
                         f"{d.num_rollout_actors}: every rollout actor needs at least one prompt a step")
    if d.max_staleness >= 1 and a.rollout_correction == "none":
        raise ValueError(f"distributed.max_staleness={d.max_staleness} with algorithm.rollout_correction=none: "
                         "stale experiences need the importance-sampling correction; set "
                         "algorithm.rollout_correction=tis (or auto) or distributed.max_staleness=0")


def _with_async_correction(config: Any) -> Any:
    """``rollout_correction: auto`` means ``tis`` when experiences may be stale (the engine's weights lag)."""
    if config.distributed.max_staleness >= 1 and config.algorithm.rollout_correction == "auto":
        algorithm = config.algorithm.model_copy(update={"rollout_correction": "tis"})
        return config.model_copy(update={"algorithm": algorithm})
    return config


class RayRun:
    """One run: the actors, the schedule, the ledger and the metrics. ``push_weights=False`` never syncs the
    rollout actors (the control of the sync check; not a user option)."""

    def __init__(self, config: Any, *, push_weights: bool = True, plan: PlacementPlan | None = None) -> None:
        import ray

        check_ray_config(config)
        self.config = _with_async_correction(config)
        d = self.config.distributed
        self.plan = plan or cluster_placement(self.config)
        self.placement_group = _reserve(self.plan)
        self.k, self.n = d.max_staleness, d.num_rollout_actors
        self.interrupted = False  # fit() stopped early on Ctrl-C / SIGTERM
        self.ledger, self.stats = ExperienceLedger(), StalenessStats()
        self.restarts = [0] * self.n
        self.failures: list[str] = []
        self._dump = self.config.model_dump(mode="json")
        self._remote_holder = ray.remote(ExperienceMakerHolder)
        self.holders = [self._start_holder(i) for i in range(self.n)]
        trainer_cls = ray.remote(RayPolicyTrainer)
        slot = self.plan.trainer[0]
        self.trainer = trainer_cls.options(**actor_options(
            trainer_name(0), slot.cpus, slot.gpus, placement_group=self.placement_group,
            bundle_index=slot.bundle_index)).remote(
            self._dump, 0, actor_threads(d.trainer_actor_cpus), push_weights=push_weights)
        ray.get(self.trainer.set_holders.remote(self.holders))
        ray.get([h.state.remote() for h in self.holders])  # built (engines loaded) before the clock starts

    def _start_holder(self, index: int) -> Any:
        d, slot = self.config.distributed, self.plan.rollout[index]
        options = actor_options(holder_name(index), slot.cpus, slot.gpus, placement_group=self.placement_group,
                                bundle_index=slot.bundle_index)  # a restarted actor takes the same bundle
        options["max_concurrency"] = 2  # weight chunks arrive while a batch is generated (see holder.py)
        for attempt in range(20):
            try:
                return self._remote_holder.options(**options).remote(self._dump, index, self.n,
                                                                     actor_threads(d.rollout_actor_cpus))
            except ValueError as exc:  # the dead actor's name is released asynchronously
                if "already taken" not in str(exc) or attempt == 19:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    # ---- the schedule ------------------------------------------------------------------------------------------
    def _submit(self, step: int, share: int) -> None:
        meta, data = self.holders[share].generate.options(num_returns=2).remote(
            step, min_rollout_version(step, self.k))
        self.pending[(step, share)] = (meta, data)

    def fit(self, max_steps: int, tracker: Any = None, on_step: Any = None) -> dict[str, float]:
        """Train ``max_steps`` steps; returns the last step's metrics. Raises :class:`RolloutActorFailure` when a
        rollout actor dies and ``distributed.on_rollout_failure`` (or the restart budget) says stop; ``self.step``
        is then the number of completed steps. Ctrl-C or SIGTERM stops after the step in progress
        (``self.interrupted``); batches generated ahead (``max_staleness``) are dropped."""

        self.pending: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.step = 0
        with stop_on_interrupt() as stop:
            last = self._loop(max_steps, tracker, on_step, stop)
        self.interrupted = stop.requested and self.step < max_steps
        self.ledger.check_all()
        return last

    def _loop(self, max_steps: int, tracker: Any, on_step: Any, stop: Any) -> dict[str, float]:
        """The steps of :meth:`fit` until ``max_steps`` or a Ctrl-C / SIGTERM (``stop``) after a finished step."""
        import ray

        t_start, eval_steps = time.perf_counter(), self.config.trainer.eval_steps
        submitted, last = -1, {}
        trainer_wait = rollout_wait = 0.0
        while self.step < max_steps and not stop.requested:
            t = self.step
            step_t0 = time.perf_counter()
            while submitted < min(t + self.k, max_steps - 1):
                submitted += 1
                for share in range(self.n):
                    self._submit(submitted, share)
            metas, datas = [], []
            for share in range(self.n):
                meta = self._await_share(t, share)
                metas.append(meta)
                datas.append(self.pending[(t, share)][1])
            waited = time.perf_counter() - step_t0
            trainer_wait += waited
            for meta in metas:
                self.ledger.produce(t, meta["share"], meta["samples"])
            out = ray.get(self.trainer.train_step.remote(t, *datas))
            for share, samples in out["consumed"]:
                self.ledger.consume(t, share, samples)
            for share in range(self.n):
                del self.pending[(t, share)]
            metrics = self._merge_rollout_metrics(metas)
            metrics.update(out["metrics"])
            metrics.update(self.ledger.check_step(t, self.n))
            for meta, s in zip(metas, out["staleness"]):
                self.stats.add(s, meta["samples"])
            self.step += 1
            try:
                for share, error in out["failed"].items():  # died while receiving the new weights
                    self._on_failure(share, error)
            except RolloutActorFailure:
                if tracker is not None:  # this step was trained (and will be checkpointed): keep its record
                    tracker.log(self.step, metrics)
                raise
            if eval_steps and (self.step % eval_steps == 0 or self.step == max_steps):
                metrics.update(ray.get(self.holders[0].evaluate.remote()))
            rollout_wait += sum(m["rollout_wait_s"] for m in metas) / self.n
            wall = time.perf_counter() - t_start
            metrics.update(self.stats.metrics(out["staleness"]))
            metrics.update({"async/trainer_wait_s": waited,
                            "async/rollout_wait_s": sum(m["rollout_wait_s"] for m in metas) / self.n,
                            "async/trainer_wait_share": trainer_wait / wall, "async/rollout_wait_share":
                            rollout_wait / wall, "async/policy_version": float(out["version"]),
                            "time/step": time.perf_counter() - step_t0, "time/wall": wall,
                            "train/samples_trained": float(sum(n for _, n in out["consumed"]))})
            last = metrics
            save_steps = self.config.trainer.save_steps
            if save_steps and self.step % save_steps == 0 and self.step < max_steps:  # the last one: run_ray
                metrics["time/save"] = _timed_save(self)
            if tracker is not None:
                tracker.log(self.step, metrics)
            if on_step is not None:
                on_step(self, metrics)
        return last

    def _await_share(self, step: int, share: int) -> dict[str, Any]:
        """The metadata of ``step``'s share from rollout actor ``share``, restarting the actor (and regenerating
        its unfinished batches) when it died and the policy allows."""
        import ray

        while True:
            try:
                return ray.get(self.pending[(step, share)][0])
            except ray.exceptions.RayActorError as exc:
                self._on_failure(share, describe_actor_error(exc))

    def _on_failure(self, share: int, error: str) -> None:
        import ray

        d = self.config.distributed
        message = f"rollout actor {holder_name(share)!r} died: {error}"
        self.failures.append(message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        if d.on_rollout_failure == "stop" or self.restarts[share] >= d.max_actor_restarts:
            why = ("distributed.on_rollout_failure=stop" if d.on_rollout_failure == "stop" else
                   f"distributed.max_actor_restarts={d.max_actor_restarts} reached")
            raise RolloutActorFailure(f"{message} ({why})")
        self.restarts[share] += 1
        ray.kill(self.holders[share], no_restart=True)
        self.holders[share] = self._start_holder(share)
        ray.get(self.trainer.set_holders.remote(self.holders))
        sync = ray.get(self.trainer.push_weights.remote([share]))
        if sync["failed"]:
            raise RolloutActorFailure(f"restarted {holder_name(share)!r} died again: {sync['failed']}")
        lost = sorted(key for key in self.pending if key[1] == share)
        for step, _ in lost:  # nothing of these reached the trainer (the ledger would refuse a second delivery)
            self._submit(step, share)
        print(f"restarted {holder_name(share)!r} ({self.restarts[share]}/{d.max_actor_restarts}); regenerating "
              f"steps {[s for s, _ in lost]}", file=sys.stderr, flush=True)

    @staticmethod
    def _merge_rollout_metrics(metas: list[dict[str, Any]]) -> dict[str, float]:
        """Rollout metrics of the step's shares: counts summed, per-sample means weighted by each share's samples
        (:func:`~mmrlhf.experience.rollout.merge_share_metrics`)."""
        total = sum(m["samples"] for m in metas)
        out = merge_share_metrics([m["metrics"] for m in metas], [m["samples"] for m in metas])
        out["samples"] = float(total)
        out["async/generate_s"] = max(m["generate_s"] for m in metas)
        return out

    def save(self) -> str:
        import ray

        return ray.get(self.trainer.save.remote(self.step))

    def shutdown(self) -> None:
        import ray

        for actor in [*self.holders, self.trainer]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # an actor already gone: nothing to stop
                logger.debug("kill %s: %s", actor, exc)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)


def cluster_placement(config: Any) -> PlacementPlan:
    """The actors' placement on the connected Ray cluster (:func:`~mmrlhf.launch.ray.runtime.plan_placement`
    with the cluster's GPU count)."""
    import ray

    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    return plan_placement(config.distributed, config.rollout.tensor_parallel_size, gpus)


def _reserve(plan: PlacementPlan) -> Any:
    """A placement group with one bundle per actor (``PACK``: on as few nodes as fit), ready."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(plan.bundles(), strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not reserve the actors' resources {plan.bundles()} within "
                           f"{PLACEMENT_TIMEOUT_S:g} s (cluster: {ray.cluster_resources()}); lower the "
                           "distributed.*_actor_cpus / *_actor_gpus keys or add nodes") from None
    return group


def run_ray(config: Any, resume: bool = False, *, on_step: Callable[[RayRun, dict], None] | None = None) -> int:
    """The Ray launch mode of ``mmrlhf train``; returns the process exit code (0 done, 1 stopped by a failure,
    2 misconfigured). ``on_step(run, metrics)`` is called after every step (tools and tests observe the run)."""
    import ray

    from mmrlhf.config import dump_config
    from mmrlhf.trainer.builder import _prepare_output
    from mmrlhf.trainer.checkpoint import CheckpointManager
    from mmrlhf.trainer.tracking import MetricsTracker

    t, d = config.trainer, config.distributed
    if resume:
        print("error: --resume is not supported with distributed.backend=ray yet (the checkpoint holds the policy "
              "in Hugging Face format: start a new run from it with model.pretrain=CHECKPOINT/model)",
              file=sys.stderr)
        return 2
    out = Path(t.output_dir)
    try:
        check_ray_config(config)
        _prepare_output(out, CheckpointManager(out / "checkpoints", t.keep_last), resume=False,
                        overwrite=t.overwrite_output_dir)
    except (OSError, ValueError) as exc:  # the output folder (in use, not writable, a run already there), the config
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(config))
    cpus = d.num_rollout_actors * d.rollout_actor_cpus + d.num_trainer_actors * d.trainer_actor_cpus
    started = connect(d.ray_address, num_cpus=cpus)
    run = None
    try:
        try:
            plan = cluster_placement(config)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        run = RayRun(config, plan=plan)
        tracker = MetricsTracker(out, tensorboard=t.tensorboard, run_config=config.model_dump(mode="json"),
                                 overwrite=t.overwrite_output_dir)
        with tracker:
            try:
                metrics = run.fit(t.max_steps, tracker, on_step)
            except RolloutActorFailure as exc:
                path = run.save()
                print(f"error: {exc}\n  stopped after step {run.step}; checkpoint saved to {path}", file=sys.stderr)
                return 1
            except ray.exceptions.RayActorError as exc:  # the trainer actor died (rollout actors are handled above)
                print(f"error: an actor died: {describe_actor_error(exc)}\n  stopped after step {run.step}; the "
                      "last periodic checkpoint (trainer.save_steps) is intact", file=sys.stderr)
                return 1
            except ray.exceptions.RayTaskError as exc:  # a data / reward / config error raised inside an actor
                cause = getattr(exc, "cause", None) or exc
                print(f"error: {type(cause).__name__}: {cause}\n  stopped after step {run.step}", file=sys.stderr)
                return 1
        path = run.save()
        if run.interrupted:
            print(f"\ninterrupted at step {run.step}: checkpoint saved to {path}; the Ray mode cannot --resume yet: "
                  f"continue from its policy with model.pretrain={Path(path) / 'model'}")
            return 0
        produced, consumed = run.ledger.check_all()
        reward = metrics.get("eval/reward/mean", metrics.get("reward/mean"))
        print(f"done: step {run.step}" + (f", reward {reward:.3f}" if reward is not None else ""))
        print(f"  experiences: {produced} samples produced, {consumed} consumed; staleness "
              f"{dict(sorted(run.stats.counts.items()))} (samples per version lag)")
        print(f"  checkpoint: {path}")
        print(f"  metrics:    {out}/metrics.jsonl")
        return 0
    finally:
        if run is not None:
            run.shutdown()
        if started:
            ray.shutdown()


def _timed_save(run: RayRun) -> float:
    t0 = time.perf_counter()
    run.save()
    return time.perf_counter() - t0

