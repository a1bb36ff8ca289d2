"""The training loop, top to bottom: rollout -> experience -> policy update -> critic update -> weight sync ->
log -> checkpoint -> evaluation -> report. Each phase is a call into a module with one job; the state a resume
needs is gathered in :meth:`Trainer.write_checkpoint` / :meth:`Trainer.load_checkpoint`.

The trainer never reads the config tree: :mod:`mmrlhf.trainer.builder` turns it into the parts and plain
settings below.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from mmrlhf.algorithms.dynamic_sampling import SampledGroups, fill_batch, filter_groups
from mmrlhf.data.stream import PromptStream, record_columns
from mmrlhf.experience.batching import TrainItem, split_experience
from mmrlhf.experience.fast_maker import scoring_temperature
from mmrlhf.experience.rollout import ScoredRollout, merge_round_metrics, merge_share_metrics
from mmrlhf.rollout.base import WAKE_KV_CACHE, WAKE_WEIGHTS
from mmrlhf.rollout.weight_sync import sync_weights
from mmrlhf.trainer.checkpoint import CheckpointManager, write_policy_and_updaters
from mmrlhf.trainer.interrupt import stop_on_interrupt
from mmrlhf.trainer.policy_update import prepare_policy_targets
from mmrlhf.trainer.progress import ProgressBar
from mmrlhf.trainer.reporting import StepReporter
from mmrlhf.trainer.state import TrainerState, restore_rng, rng_state_json, rng_state_tensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    """Plain values the loop reads (from ``trainer`` and ``algorithm``)."""

    max_steps: int
    rollout_batch_size: int
    output_dir: str
    save_steps: int = 100
    log_steps: int = 1
    eval_steps: int = 0
    report_steps: int = 50
    dynamic_sampling: bool = False
    dynamic_sampling_max_extra_rounds: int = 3
    dynamic_sampling_tol: float = 0.0
    progress_bar: bool = True
    sync_only_trainable: bool = True
    config: dict[str, Any] = field(default_factory=dict)  # the resolved run config (saved with checkpoints)


@dataclass
class TrainerParts:
    """Everything the loop drives (built by ``builder.build_trainer``)."""

    maker: Any  # FastExperienceMaker (its actor, engine, reference and critic)
    policy: Any  # PolicyUpdater
    critic: Any | None  # CriticUpdater
    stream: PromptStream
    evaluator: Any | None  # Evaluator
    tracker: Any  # MetricsTracker
    checkpoints: CheckpointManager
    reporter: StepReporter
    processor: Any  # saved beside the model in checkpoints (tokenizer, chat template, image processor)
    shuffle: torch.Generator  # mini-batch order (checkpointed)
    dist: Any = None  # DistContext under torchrun: this rank's share of the prompts, sharded models, rank-0 output


class Trainer:
    def __init__(self, parts: TrainerParts, settings: LoopSettings) -> None:
        self.p, self.s = parts, settings
        self.state = TrainerState()
        self.last_metrics: dict[str, float] = {}
        self.last_rollout: ScoredRollout | None = None
        self.last_items: list[TrainItem] = []

    # ---- the loop --------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Run until ``max_steps``; Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and returns. The
        last step is always evaluated (when evaluation is on), saved and reported."""
        s, p = self.s, self.p
        bar = ProgressBar(s.max_steps, initial=self.state.step, enabled=s.progress_bar)
        with stop_on_interrupt() as stop, bar:
            while self.state.step < s.max_steps and not stop.requested:
                t0 = time.perf_counter()
                metrics = self.train_step()
                self.state.step += 1
                if p.dist is not None:  # a Ctrl-C / SIGTERM seen by any rank stops every rank after the same step
                    stop.requested = not p.dist.all_true(not stop.requested)
                metrics["time/step"] = time.perf_counter() - t0
                step, last = self.state.step, self.state.step == s.max_steps
                if p.evaluator is not None and s.eval_steps and (step % s.eval_steps == 0 or last) and self.main:
                    t_eval = time.perf_counter()
                    metrics.update(self.evaluate())
                    metrics["time/eval"] = time.perf_counter() - t_eval
                self.last_metrics = metrics
                if step % s.log_steps == 0 or last or stop.requested:
                    p.tracker.log(step, metrics)
                bar.update(metrics, self.state.last_eval)
                if step % s.save_steps == 0 or last or stop.requested:
                    self.save()
                if ((s.report_steps and step % s.report_steps == 0) or last or stop.requested) and self.main:
                    self.report()
        if stop.requested and self.state.step < s.max_steps:
            latest = p.checkpoints.latest()
            if latest is None or p.checkpoints.step_of(latest) != self.state.step:
                latest = self.save()  # the signal came between the step's save check and the loop test
            if self.main:
                print(f"\ninterrupted at step {self.state.step}: checkpoint saved to {latest}; continue with --resume")
        return self.last_metrics

    @property
    def main(self) -> bool:
        """Whether this process writes the run's output (always, except ranks > 0 under torchrun)."""
        return self.p.dist is None or self.p.dist.is_main

    def train_step(self) -> dict[str, float]:
        seconds: dict[str, float] = {}
        with _timed(seconds, "rollout"):
            rollout, metrics = self.collect_rollout()
        metrics = self.train_on(rollout, metrics, seconds)
        if self.p.dist is not None:
            metrics = _mean_over_ranks(self.p.dist, metrics)
        return metrics

    def train_on(self, rollout: ScoredRollout | None, metrics: dict[str, float],
                 seconds: dict[str, float] | None = None) -> dict[str, float]:
        """Experiences, policy and critic updates and the weight sync for one rollout (this rank's share under
        torchrun); ``metrics`` (the rollout's) are extended and returned."""
        p = self.p
        seconds = {} if seconds is None else seconds
        if rollout is None:  # dynamic sampling found no group with reward variance
            self.state.empty_steps += 1
            logger.warning("step %d: every sampled group had the same reward for all its samples; no update",
                           self.state.step + 1)
            metrics["train/empty_steps"] = float(self.state.empty_steps)
            return metrics
        engine = p.maker.engine
        # A sleeping engine (vLLM sleep mode, rollout.enable_sleep on CUDA) hands its GPU memory to the forwards and
        # the updates. It wakes in two parts: its weights before the sync (the trainer still holds its memory), its
        # KV cache only after the sync, so the peak is trainer + engine weights, never trainer + whole engine. An
        # update that fails wakes everything; a failed sync still wakes the KV cache.
        sleeps = bool(getattr(engine, "supports_sleep", False))
        if sleeps:
            with _timed(seconds, "engine_sleep"):
                engine.sleep()
        updated = False
        try:
            with _timed(seconds, "experience"):
                experiences = p.maker.experiences_from(rollout, pad_forwards_to=self._forwards_over_ranks(rollout))
                items = [item for exp in experiences for item in split_experience(exp)]
                metrics.update({k: v for k, v in experiences[0].info["batch"].items() if k not in metrics})
                metrics.update(prepare_policy_targets(items, p.policy.s))
                metrics.update(_entropy_metric(items))
            with _timed(seconds, "policy_update"):
                metrics.update(p.policy.update(items, temperature=scoring_temperature(rollout.sampling),
                                               generator=p.shuffle))
            if p.critic is not None:
                with _timed(seconds, "critic_update"):
                    metrics.update(p.critic.update(items, generator=p.shuffle))
            updated = True
        finally:
            if sleeps:
                with _timed(seconds, "engine_wake"):
                    engine.wake_up(tags=WAKE_WEIGHTS if updated else None)
        # Sleep level 2 discards the engine's weights: the sync must then restore all of them, frozen ones too.
        only_trainable = self.s.sync_only_trainable and not (sleeps and getattr(engine, "sleep_discards_weights",
                                                                                  False))
        try:
            with _timed(seconds, "sync"):
                metrics.update(sync_weights(p.policy.actor.model, engine, only_trainable=only_trainable))
        finally:
            if sleeps:
                with _timed(seconds, "engine_wake_kv"):
                    engine.wake_up(tags=WAKE_KV_CACHE)
        trained = sum(1 for it in items if bool(it.token["loss_mask"].any()))  # masked samples train nothing
        metrics["train/samples_trained"] = float(trained)
        generated = float(metrics.get("samples", len(rollout)))
        if p.dist is not None:  # every rank keeps the run's totals (rank 0's are saved and restored into all)
            generated, trained = p.dist.all_sum([generated, float(trained)])
        self.state.samples_generated += int(generated)
        self.state.samples_trained += int(trained)
        metrics.update({f"time/{k}": v for k, v in seconds.items()})
        self.last_rollout, self.last_items = rollout, items
        return metrics

    def _forwards_over_ranks(self, rollout: ScoredRollout) -> int | None:
        """Under torchrun: the most scoring micro-batches any rank holds this step (a rank with a skipped prompt holds
        fewer, and its sharded forwards must still pair with the others'); None in one process."""
        if self.p.dist is None:
            return None
        micro = self.p.maker.settings.micro_batch_size
        return int(self.p.dist.all_max([float(math.ceil(len(rollout) / micro))])[0])

    # ---- phases ------------------------------------------------------------------------------------------------
    def collect_rollout(self) -> tuple[ScoredRollout | None, dict[str, float]]:
        """One round of ``rollout_batch_size`` prompts, or (dynamic sampling) rounds until that many groups with
        reward variance are kept. Metrics describe everything sampled; the rollout holds what trains."""
        s, rounds = self.s, []

        def sample_round() -> SampledGroups:
            rollout = self._sample(s.rollout_batch_size)
            rounds.append(rollout)
            return SampledGroups(*_group_rewards(rollout), payload=rollout)

        if not s.dynamic_sampling:
            rollout = self._sample(s.rollout_batch_size)
            metrics = dict(rollout.metrics)
            metrics.update(_variance_metrics([rollout], s.dynamic_sampling_tol))
            return rollout, metrics
        fill = fill_batch(sample_round, s.rollout_batch_size, s.dynamic_sampling_max_extra_rounds,
                          tol=s.dynamic_sampling_tol)
        metrics = merge_round_metrics([r.metrics for r in rounds], [len(r) for r in rounds])
        metrics.update(_variance_metrics(rounds, s.dynamic_sampling_tol))
        metrics.update(fill.metrics())
        if not fill.parts:
            return None, metrics
        kept = ScoredRollout.concat([part.payload.select(part.indices.tolist()) for part in fill.parts])
        return kept, metrics

    def _sample(self, n_prompts: int) -> ScoredRollout:
        records = self.p.stream.next_batch(n_prompts)  # every rank draws the same global batch (same seed) ...
        if self.p.dist is not None:  # ... and generates its own share of whole prompts
            records = records[self.p.dist.rank::self.p.dist.world_size]
        return self.p.maker.generate_rollout(**record_columns(records))

    def evaluate(self) -> dict[str, float]:
        metrics = self.p.evaluator.run()
        self.state.last_eval = metrics
        return metrics

    def report(self) -> None:
        self.p.reporter.write(self.state.step, self.p.tracker.history(), self.last_rollout, self.last_items,
                              self.last_metrics)

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self) -> Path:
        if self.p.dist is not None:
            from mmrlhf.distributed.checkpoint import save_collective

            path = save_collective(self.p.dist, self.p.checkpoints, self.state.step, self.write_checkpoint)
        else:
            path = self.p.checkpoints.save(self.state.step, self.write_checkpoint)
        logger.info("checkpoint saved: %s", path)
        return path

    def write_checkpoint(self, folder: Path) -> None:
        """Everything a resume needs: the policy in Hugging Face format (``model/``, loadable by transformers and
        vLLM), the critic, optimiser and scheduler states, RNG states, data position and running statistics."""
        p = self.p
        if p.dist is not None:
            from mmrlhf.distributed.checkpoint import write_sharded

            write_sharded(self, folder)
            return
        write_policy_and_updaters(folder, p.policy, p.critic, p.processor)
        torch.save(rng_state_tensors({"shuffle": p.shuffle}), folder / "rng.pt")
        state = {"trainer": self.state.to_json(), "stream": p.stream.state_dict(), "maker": p.maker.state_dict(),
                 "rng": rng_state_json(), "config": self.s.config}
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=1, default=float))

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore everything but the policy weights (the builder loads those from ``folder/model``)."""
        folder, p = Path(folder), self.p
        if p.dist is not None:
            from mmrlhf.distributed.checkpoint import load_sharded

            load_sharded(self, folder)
            return
        state = json.loads((folder / "trainer_state.json").read_text())
        self.state = TrainerState.from_json(state["trainer"])
        p.stream.load_state_dict(state["stream"])
        p.maker.load_state_dict(state["maker"])
        optim = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
        p.policy.stepper.load_state_dict(optim["policy"])
        if p.critic is not None:
            from safetensors.torch import load_file

            p.critic.critic.load_state_dict(load_file(str(folder / "critic.safetensors")))
            p.critic.stepper.load_state_dict(optim["critic"])
        rng = torch.load(folder / "rng.pt", weights_only=True)
        restore_rng(state["rng"], rng, {"shuffle": p.shuffle})
        p.tracker.truncate_after(self.state.step)


# ---- helpers -------------------------------------------------------------------------------------------------
def _group_rewards(rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] rewards, [N] group ids) for group filtering; samples the reward engine masked out get a group of their
    own (a singleton has no spread and is dropped), so a masked 0 never fakes variance in its prompt's group."""
    r = rollout.rewards
    groups = rollout.group_ids
    alone = groups.max() + 1 + torch.arange(len(groups))
    return r.rewards.float(), torch.where(r.valid, groups, alone)


def _mean_over_ranks(dist: Any, metrics: dict[str, float]) -> dict[str, float]:
    """The step's metrics from every rank's share: counts summed, per-sample means weighted by each rank's samples
    (ranks may hold different numbers after skipped prompts), times the slowest rank's
    (:func:`~mmrlhf.experience.rollout.merge_share_metrics`)."""
    import torch.distributed as tdist

    gathered: list[Any] = [None] * dist.world_size
    tdist.all_gather_object(gathered, metrics)
    return merge_share_metrics(gathered, [m.get("samples", 1.0) for m in gathered])


def _variance_metrics(rounds: Sequence[ScoredRollout], tol: float) -> dict[str, float]:
    """Share of sampled groups whose rewards vary: the early warning of GRPO collapse (no variance, no signal)."""
    kept = total = 0
    for rollout in rounds:
        rewards, groups = _group_rewards(rollout)
        valid_groups = groups[rollout.rewards.valid]
        if not valid_groups.numel():
            continue
        sel = filter_groups(rewards[rollout.rewards.valid], valid_groups, tol=tol)
        kept += int(sel.kept_groups.numel())
        total += sel.num_groups
    return {"groups/with_variance_frac": kept / total if total else 0.0, "groups/sampled": float(total)}


def _entropy_metric(items: Sequence[TrainItem]) -> dict[str, float]:
    """Mean old-policy entropy over the trained response tokens (``policy/entropy``)."""
    num = den = 0.0
    for it in items:
        ent = it.token.get("action_entropy")
        if ent is None:
            return {}
        mask = it.token["loss_mask"]
        num += float(ent[mask].sum())
        den += int(mask.sum())
    return {"policy/entropy": num / den} if den else {}


@contextmanager
def _timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0



