"""One rank's run from config to exit code: build the trainer, train, say where the results are. The one-process
mode is this with a world of one rank; torchrun ranks and Ray trainer actors call it with theirs."""

from __future__ import annotations

import sys
from typing import Any

from mmrlhf.parallel.world import World


def runtime_user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user's data, rewards or settings can raise in the middle of a run: reported as one ``error:``
    line (they name the record, the source or the key), not a traceback."""
    from mmrlhf.data.errors import DataError
    from mmrlhf.experience.kinds.single_turn import PromptMismatchError
    from mmrlhf.rewards.types import RewardError
    from mmrlhf.rollout.types import PromptTooLongError, RequestRejectedError
    from mmrlhf.trainer.checkpoint import CheckpointSpaceError
    from mmrlhf.trainer.rollouts import EmptyStepError

    return (DataError, RewardError, PromptMismatchError, PromptTooLongError, RequestRejectedError, CheckpointSpaceError,
            EmptyStepError)


def user_message(exc: BaseException) -> str:
    """What an ``error:`` line says of ``exc``: its own message, also where it was raised in a Ray actor (Ray's
    task error is an instance of the actor's exception class, and its text carries the actor's traceback: the
    cause's message is what names the record or the key)."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)


def build_or_report(config: Any, *, resume: bool, world: World | None = None, who: str = "") -> Any:
    """The rank's trainer (an engine in this process), or None after printing the ``error:`` line of a
    configuration, output folder, checkpoint or model-file problem (exit code 2)."""
    from mmrlhf.trainer.builder import build_trainer

    try:
        return build_trainer(config, resume=resume, world=world)
    except (OSError, ValueError) as exc:
        print(f"error{who}: {exc}", file=sys.stderr)
        return None


def fit_or_report(trainer: Any, who: str = "") -> tuple[int, dict[str, float]]:
    """Train; (exit code, last metrics). A non-finite stop, a user error or the end of the rollouts is one
    ``error:`` line naming the last checkpoint (the end of the rollouts saves the finished steps first)."""
    from mmrlhf.trainer.minibatch import NonFiniteError
    from mmrlhf.trainer.rollouts import RolloutSourceError

    try:
        with trainer.p.tracker:
            return 0, trainer.fit()
    except RolloutSourceError as exc:
        path = trainer.save()
        print(f"error{who}: {exc}\n  stopped after step {trainer.state.step}; checkpoint saved to {path}",
              file=sys.stderr)
        return 1, {}
    except (NonFiniteError, *runtime_user_errors()) as exc:
        latest = trainer.p.checkpoints.latest()
        where = f"; the last checkpoint is {latest}" if latest is not None else ""
        print(f"error{who}: {user_message(exc)}{where}", file=sys.stderr)
        return 1, {}
    finally:
        trainer.p.source.close()


def train_and_report(config: Any, *, resume: bool, world: World | None = None) -> int:
    """Build, write ``config.yaml`` (rank 0), train, print the summary (rank 0); the exit code of ``mmrlhf train``."""
    from mmrlhf.config import dump_config

    who = "" if world is None or world.world_size == 1 else f" (rank {world.rank})"
    trainer = build_or_report(config, resume=resume, world=world, who=who)
    if trainer is None:
        return 2
    if trainer.main:
        with open(f"{trainer.s.output_dir}/config.yaml", "w") as f:
            f.write(dump_config(config))
    code, metrics = fit_or_report(trainer, who)
    if code == 0 and trainer.main:
        print_summary(trainer, metrics)
    return code


def print_summary(trainer: Any, metrics: dict[str, float]) -> None:
    """Where the results are (rank 0)."""
    out, world = trainer.s.output_dir, trainer.p.world
    latest = trainer.p.checkpoints.latest()
    reward = metrics.get("eval/reward/mean", metrics.get("reward/mean"))
    ranks = f" on {world.world_size} ranks" if world.world_size > 1 else ""
    print(f"done: step {trainer.state.step}{ranks}" + (f", reward {reward:.3f}" if reward is not None else ""))
    print(f"  curves:     {trainer.p.reporter.curves_path}")
    print(f"  report:     {trainer.p.reporter.report_path}")
    print(f"  checkpoint: {latest}")
    print(f"  metrics:    {out}/metrics.jsonl (TensorBoard: tensorboard --logdir {out}/tensorboard)")
