"""The training loop, top to bottom, written once for every launch mode: rollout -> experience -> policy update ->
critic update -> weight sync -> log -> checkpoint -> evaluation -> report. Each phase is a call into a module with
one job; what a resume needs is written and read by :mod:`mmrlhf.trainer.run_checkpoint`.

A launch mode (:mod:`mmrlhf.launch`) decides two things only: where a step's experiences come from (the
:class:`~mmrlhf.trainer.rollouts.RolloutSource`: an engine in this process, or the Ray rollout actors) and how many
ranks train (the :class:`~mmrlhf.parallel.world.World`: one process is a world of one rank). The trainer never reads
the config tree: :mod:`mmrlhf.trainer.builder` turns it into the parts and plain settings below.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mmrlhf.experience.batching import TrainItem
from mmrlhf.experience.rollout import merge_share_metrics
from mmrlhf.parallel.world import World
from mmrlhf.rollout.types import RANK_SEED_SCHEMES
from mmrlhf.trainer.checkpoint import CheckpointManager, save_collective
from mmrlhf.trainer.interrupt import stop_on_interrupt
from mmrlhf.trainer.policy_update import prepare_policy_targets
from mmrlhf.trainer.progress import ProgressBar
from mmrlhf.trainer.reporting import StepReporter, is_report_step
from mmrlhf.trainer.rollouts import RolloutSource, StepBatch, timed
from mmrlhf.trainer.run_checkpoint import load_run_state, write_run_state
from mmrlhf.trainer.state import TrainerState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    """Plain values the loop reads (from ``trainer``)."""

    max_steps: int
    output_dir: str
    save_steps: int = 100
    log_steps: int = 1
    eval_steps: int = 0
    report_steps: int = 50
    progress_bar: bool = True
    config: dict[str, Any] = field(default_factory=dict)  # the resolved run config (saved with checkpoints)
    # how the ranks' sampling seeds derive from rollout.seed (mmrlhf.rollout.types.rank_seed; saved with checkpoints)
    rank_seeds: str = RANK_SEED_SCHEMES[0]


@dataclass
class TrainerParts:
    """Everything the loop drives (built by ``builder.build_trainer``)."""

    source: RolloutSource  # where this rank's experiences come from, and where new weights go
    policy: Any  # PolicyUpdater
    critic: Any | None  # CriticUpdater
    tracker: Any  # MetricsTracker (rank 0) or SilentTracker
    checkpoints: CheckpointManager
    reporter: StepReporter
    processor: Any  # saved beside the model in checkpoints (tokenizer, chat template, image processor)
    shuffle: Any  # torch.Generator of the mini-batch order (checkpointed)
    world: World  # this rank among the training ranks (a world of one in one process)


class Trainer:
    def __init__(self, parts: TrainerParts, settings: LoopSettings) -> None:
        self.p, self.s = parts, settings
        self.state = TrainerState()
        self.last_metrics: dict[str, float] = {}
        self.last_batch: StepBatch | None = None  # the last trained step's batch (its report is drawn from it)
        self.stop_requested = False  # set from outside (the Ray driver's Ctrl-C) to stop after the current step

    # ---- the loop --------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Run until ``max_steps``; Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and returns. The
        last step is always evaluated (when evaluation is on), saved and reported."""
        s, p = self.s, self.p
        bar = ProgressBar(s.max_steps, initial=self.state.step, enabled=s.progress_bar and self.main)
        p.source.start(self.state.step, p.policy, p.critic)
        with stop_on_interrupt() as stop, bar:
            while self.state.step < s.max_steps and not stop.requested:
                t0 = time.perf_counter()
                metrics = self.train_step()
                self.state.step += 1
                # a Ctrl-C / SIGTERM seen by any rank stops every rank after the same step
                stop.requested = not p.world.all_true(not (stop.requested or self.stop_requested))
                metrics["time/step"] = time.perf_counter() - t0
                step, last = self.state.step, self.state.step == s.max_steps
                if s.eval_steps and (step % s.eval_steps == 0 or last) and self.evaluates:
                    t_eval = time.perf_counter()
                    evaluated = self.evaluate()
                    if self.main:  # (the other ranks of rank 0's engine group evaluate beside it, unrecorded)
                        metrics.update(evaluated)
                        metrics["time/eval"] = time.perf_counter() - t_eval
                self.last_metrics = metrics
                if step % s.log_steps == 0 or last or stop.requested:
                    p.tracker.log(step, metrics)
                bar.update(metrics, self.state.last_eval)
                if step % s.save_steps == 0 or last or stop.requested:
                    self.save()
                if (is_report_step(step, s.report_steps, s.max_steps) or stop.requested) and self.main:
                    self.report()
        self.interrupted = stop.requested and self.state.step < s.max_steps
        if self.interrupted:
            latest = p.checkpoints.latest()
            if latest is None or p.checkpoints.step_of(latest) != self.state.step:
                latest = self.save()  # the signal came between the step's save check and the loop test
            if self.main:
                print(f"\ninterrupted at step {self.state.step}: checkpoint saved to {latest}; continue with --resume")
        return self.last_metrics

    @property
    def main(self) -> bool:
        """Whether this process writes the run's output (rank 0)."""
        return self.p.world.is_main

    @property
    def evaluates(self) -> bool:
        """Whether this process runs the held-out evaluation: rank 0, and the ranks whose engine is rank 0's
        (``rollout.tensor_parallel_size`` > 1 under torchrun: every rank of an engine group makes its calls)."""
        return self.main or bool(getattr(self.p.source, "evaluates_beside_main", False))

    def train_step(self) -> dict[str, float]:
        """One step: this rank's experiences from the source, the updates, the new weights published; the metrics
        of the whole step (every rank's share merged)."""
        batch = self.p.source.collect(self.state.step)
        metrics = self.train_on(batch)
        shares = self.p.world.gather_objects(metrics)
        return merge_share_metrics(shares, [m.get("samples", 1.0) for m in shares])

    def train_on(self, batch: Any) -> dict[str, float]:
        """Policy and critic updates on this rank's share of a step (a :class:`~mmrlhf.trainer.rollouts.StepBatch`),
        then the source publishes the new weights; the batch's metrics, extended."""
        p, metrics, seconds = self.p, dict(batch.metrics), dict(batch.seconds)
        items = batch.items
        if not self.p.world.all_max([float(len(items))])[0]:  # dynamic sampling kept no group with variance
            self.state.empty_steps += 1
            logger.warning("step %d: every sampled group had the same reward for all its samples; no update",
                           self.state.step + 1)
            metrics["train/empty_steps"] = float(self.state.empty_steps)
            return metrics
        updated = False
        try:
            items, targets = prepare_policy_targets(items, p.policy.s, p.world)
            metrics.update(targets)
            metrics.update(_entropy_metric(items, p.world))
            with timed(seconds, "policy_update"):
                metrics.update(p.policy.update(items, distribution=batch.distribution, generator=p.shuffle))
            if p.critic is not None:
                with timed(seconds, "critic_update"):
                    metrics.update(p.critic.update(items, generator=p.shuffle))
            updated = True
        finally:
            published = p.source.publish(p.policy, p.critic, updated=updated)
        metrics.update(published)
        trained = sum(1 for it in items if bool(it.token["loss_mask"].any()))  # masked samples train nothing
        metrics["train/samples_trained"] = float(trained)
        generated = float(metrics.get("samples", len(items)))
        generated, trained_all = p.world.all_sum([generated, float(trained)])  # every rank keeps the run's totals
        self.state.samples_generated += int(generated)
        self.state.samples_trained += int(trained_all)
        metrics.update({f"time/{k}": v for k, v in seconds.items()})
        self.last_batch = batch
        return metrics

    # ---- phases ------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        metrics = self.p.source.evaluate()
        self.state.last_eval = metrics
        return metrics

    def report(self) -> None:
        self.p.reporter.write(self.state.step, self.p.tracker.history(), self.p.reporter.shown(self.last_batch),
                              self.last_metrics)

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self) -> Path:
        """A checkpoint of the finished steps, written by every rank into one folder (collective)."""
        path = save_collective(self.p.world, self.p.checkpoints, self.state.step, self.write_checkpoint)
        logger.info("checkpoint saved: %s", path)
        return path

    def write_checkpoint(self, folder: Path) -> None:
        write_run_state(self, folder)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore everything but the policy weights (the builder loads those from ``folder/model``)."""
        load_run_state(self, Path(folder))
        self.p.tracker.truncate_after(self.state.step)


# ---- helpers -------------------------------------------------------------------------------------------------
def _entropy_metric(items: Sequence[TrainItem], world: World) -> dict[str, float]:
    """Mean old-policy entropy over the trained response tokens of every rank (``policy/entropy``)."""
    num = den = 0.0
    for it in items:
        ent = it.token.get("action_entropy")
        if ent is None:
            return {}
        mask = it.token["loss_mask"]
        num += float(ent[mask].sum())
        den += int(mask.sum())
    num, den = world.all_sum([num, den])
    return {"policy/entropy": num / den} if den else {}
