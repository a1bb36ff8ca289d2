"""``mmrlhf train CONFIG distributed.backend=ray``: start (or join) Ray, place the rollout actors and the trainer
actors, and let the trainer actors run the one training loop.

The driver owns no step: it starts the actors in one placement group, has the trainer actors form their process
group, calls ``fit`` on each (:class:`~mmrlhf.launch.ray.trainer_actor.RayTrainerRank`) and waits, passing a Ctrl-C
or SIGTERM on to rank 0 (which stops every rank after the step in progress and saves). Experiences never pass
through the driver: a rollout actor's go through the object store to trainer rank 0, which deals each rank its
groups (:class:`~mmrlhf.launch.ray.source.RayRollouts`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from mmrlhf.launch.ray.exchange import start_step_exchange
from mmrlhf.launch.ray.pool import HolderPool
from mmrlhf.launch.ray.runtime import PlacementPlan, check_custom_resources, plan_placement
from mmrlhf.parallel.ray_actors import actor_options, actor_threads, connect, describe_actor_error
from mmrlhf.launch.ray.trainer_actor import RayTrainerRank, trainer_name
from mmrlhf.startup import loaded
from mmrlhf.trainer.interrupt import stop_on_interrupt

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 600.0  # how long the actors' placement group may wait for the cluster's resources


def check_ray_config(config: Any) -> None:
    """What the Ray mode cannot do: refused by key, before anything starts. (Several rollout actors take a step's
    statistics, running state and dynamic sampling's choice together: :mod:`mmrlhf.launch.ray.exchange`.)"""
    d, t, a = config.distributed, config.trainer, config.algorithm
    if t.rollout_batch_size < d.num_rollout_actors:
        raise ValueError(f"trainer.rollout_batch_size={t.rollout_batch_size} < distributed.num_rollout_actors="
                         f"{d.num_rollout_actors}: every rollout actor needs at least one prompt a step")
    if t.rollout_batch_size < d.num_trainer_actors:
        raise ValueError(f"trainer.rollout_batch_size={t.rollout_batch_size} < distributed.num_trainer_actors="
                         f"{d.num_trainer_actors}: every trainer actor needs at least one prompt group a step")
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
    """The actors of one run: the rollout actors' pool and the trainer ranks. ``push_weights=False`` never syncs
    the rollout actors (the control of the sync check; not a user option)."""

    def __init__(self, config: Any, *, push_weights: bool = True, plan: PlacementPlan | None = None) -> None:
        import ray

        check_ray_config(config)
        self.config = _with_async_correction(config)
        d = self.config.distributed
        self.plan = plan or cluster_placement(self.config)
        self.placement_group = _reserve(self.plan)
        # The judges' own actors (reward backend "ray"), outside the placement group, owned by this driver: they
        # live as long as the run and every rollout actor finds them by name.
        from mmrlhf.rewards.judge.ray_actor import start_judge_actors

        self.judges = start_judge_actors(self.config.reward)
        # several rollout actors meet in each step's collectives (shaping statistics, running state, the choice of
        # dynamic sampling) through one small actor
        self.exchange = start_step_exchange(len(self.plan.rollout)) if len(self.plan.rollout) > 1 else None
        dump = self.config.model_dump(mode="json")
        dump["trainer"]["progress_bar"] = False  # the ranks' output reaches the driver only at the end
        self.pool = HolderPool(dump, self.plan, self.placement_group, exchange=self.exchange)
        self.pool.start_all()
        remote = ray.remote(RayTrainerRank)
        n = d.num_trainer_actors
        self.ranks = []
        for rank, slot in enumerate(self.plan.trainer):
            options = actor_options(trainer_name(rank), slot.cpus, slot.gpus, placement_group=self.placement_group,
                                    bundle_index=slot.bundle_index)
            options["max_concurrency"] = 2  # progress and stop requests while fit() runs
            self.ranks.append(remote.options(**options).remote(dump, rank, n, actor_threads(d.trainer_actor_cpus),
                                                                self.pool, push_weights=push_weights))
        self.step = 0

    def setup(self, resume: bool) -> list[str]:
        """Every rank joins the process group and builds its trainer (together: the rendezvous waits for all) while
        the rollout actors load their engines; the error lines of the ranks that refused the run (then nobody waits
        for the engines), else waits for every rollout actor (the clock starts with every engine up). A rollout
        actor that failed to build raises its error first."""
        import ray

        address = ray.get(self.ranks[0].address.remote())
        refs = [r.setup.remote(resume, address) for r in self.ranks]
        try:
            errors = [e for e in ray.get(refs) if e]
        except ray.exceptions.RayError:
            self.pool.ready()  # a rank that called a rollout actor which could not be built: that is the cause
            raise
        if not errors:
            self.pool.ready()
        return errors

    def fit(self, on_step: Callable[["RayRun", int], None] | None = None) -> dict[str, Any]:
        """Every rank's ``fit`` (the one loop), awaited; a Ctrl-C or SIGTERM asks rank 0 to stop after the step in
        progress. ``on_step(run, step)`` is called as steps finish (tools and tests observe the run). Returns rank
        0's result; raises the error of a rank that died or raised."""
        import ray

        refs = [r.fit.remote() for r in self.ranks]
        asked = False
        with stop_on_interrupt() as stop:
            while True:
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.1)
                for ref in done:
                    ray.get(ref)  # a rank that died or raised ends the run now (the others may wait on it)
                if len(done) == len(refs):
                    break
                if stop.requested and not asked:
                    self.ranks[0].request_stop.remote()
                    asked = True
                step = ray.get(self.ranks[0].progress.remote())
                if step != self.step:
                    self.step = step
                    if on_step is not None:
                        on_step(self, step)
        results = ray.get(refs)
        self.step = results[0]["step"]
        return results[0]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in [*self.pool.handles, *self.ranks, *self.judges, *filter(None, [self.exchange])]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # an actor already gone: nothing to stop
                logger.debug("kill %s: %s", actor, exc)
        remove_placement_group(self.placement_group)  # also ends rollout actors restarted by trainer rank 0


def cluster_placement(config: Any) -> PlacementPlan:
    """The actors' placement on the connected Ray cluster (:func:`~mmrlhf.launch.ray.runtime.plan_placement`
    with the cluster's GPU count; the custom resources the actors ask for must be in the cluster)."""
    import ray

    resources = ray.cluster_resources()
    gpus = float(resources.get("GPU", 0.0))
    plan = plan_placement(config.distributed, config.rollout.tensor_parallel_size, gpus)
    check_custom_resources(config.distributed, plan, resources)
    _check_judges(config, plan, gpus)
    return plan


def placement_error(exc: ValueError, *, own_ray: bool) -> str:
    """The error line of a refused placement; where the refusal is a custom resource and the run started a Ray of
    its own (which has none), how to join the cluster that has them."""
    hint = ("\n  (this run started a Ray instance of its own on this machine: to run on your cluster, set "
            "distributed.ray_address or RAY_ADDRESS)") if own_ray and "of the Ray resource" in str(exc) else ""
    return f"error: {exc}{hint}"


def _check_judges(config: Any, plan: PlacementPlan, cluster_gpus: float) -> None:
    """The judges' own actors (reward backend ``ray``) must fit beside the placement group's GPUs."""
    from mmrlhf.rewards.judge.ray_actor import actor_resources, ray_judges

    judges = {name: actor_resources(name, cfg, cluster_gpus)[1] for name, cfg in ray_judges(config.reward).items()}
    if judges and plan.gpus + sum(judges.values()) > cluster_gpus > 0:
        keys = ", ".join(f"reward.label_map.{name}.actor_gpus={g:g}" for name, g in judges.items())
        raise ValueError(f"the rollout and trainer actors need {plan.gpus:g} GPUs and the judges {keys}, but the "
                         f"cluster has {cluster_gpus:g}: lower those keys or the distributed.*_actor_gpus ones")


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


def run_ray(config: Any, resume: bool = False, *, on_step: Callable[[RayRun, int], None] | None = None,
            push_weights: bool = True) -> int:
    """The Ray launch mode of ``mmrlhf train``; returns the process exit code (0 done or interrupted with a
    checkpoint, 1 stopped by a failure, 2 misconfigured)."""
    import ray

    from mmrlhf.trainer.preflight import check_before_models

    d = config.distributed
    try:
        check_ray_config(config)
        check_before_models(config)  # what the config and the data tell, before any actor starts
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mmrlhf.rewards.judge.ray_actor import ray_judges

    cpus = d.num_rollout_actors * d.rollout_actor_cpus + d.num_trainer_actors * d.trainer_actor_cpus
    cpus += sum(judge.actor_cpus for judge in ray_judges(config.reward).values())  # a local Ray: theirs too
    started = connect(d.ray_address, num_cpus=cpus)
    run = None
    try:
        try:
            plan = cluster_placement(config)
        except ValueError as exc:
            local = started and not (d.ray_address or os.environ.get("RAY_ADDRESS"))
            print(placement_error(exc, own_ray=local), file=sys.stderr)
            return 2
        run = RayRun(config, plan=plan, push_weights=push_weights)
        try:
            errors = run.setup(resume)
            loaded()  # this process too (``mmrlhf train`` deferred its full collections: mmrlhf.startup)
            if errors:  # every rank reports the same refusal: say it once
                for message in dict.fromkeys(e.split(": ", 1)[1] for e in errors):
                    print(f"error: {message}", file=sys.stderr)
                return 2
            result = run.fit(on_step)
        except ray.exceptions.RayActorError as exc:  # a trainer actor died
            print(f"error: an actor died: {describe_actor_error(exc)}\n  stopped after step {run.step}; the last "
                  "periodic checkpoint (trainer.save_steps) is intact", file=sys.stderr)
            return 1
        except ray.exceptions.RayTaskError as exc:  # an unexpected error inside a trainer actor
            cause = getattr(exc, "cause", None) or exc
            print(f"error: {type(cause).__name__}: {cause}\n  stopped after step {run.step}", file=sys.stderr)
            return 1
        print(result["stdout"], end="")
        print(result["stderr"], end="", file=sys.stderr)
        if result["code"] or result["interrupted"]:
            return result["code"]
        _print_summary(result, config.trainer.output_dir)
        return 0
    finally:
        if run is not None:
            run.shutdown()
        if started:
            ray.shutdown()


def _print_summary(result: dict[str, Any], out: str) -> None:
    metrics, summary = result["metrics"], result["summary"]
    reward = metrics.get("eval/reward/mean", metrics.get("reward/mean"))
    print(f"done: step {result['step']}" + (f", reward {reward:.3f}" if reward is not None else ""))
    print(f"  experiences: {summary['produced']} samples produced, {summary['consumed']} consumed; staleness "
          f"{summary['staleness']} (samples per version lag)")
    print(f"  checkpoint: {result['checkpoint']}")
    print(f"  metrics:    {out}/metrics.jsonl")
