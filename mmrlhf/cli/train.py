"""``mmrlhf train CONFIG [section.key=value ...] [--resume]``: run GRPO / PPO training from a recipe."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train a policy with GRPO / PPO from a YAML recipe",
        description="Load CONFIG, apply the dotted overrides (section.key=value), build the models, the rollout "
        "engine, the rewards and the trainer, and train for trainer.max_steps rollout steps. Metrics go to "
        "OUTPUT_DIR/metrics.jsonl and TensorBoard; curves.png, report.html and checkpoints/ are written there too. "
        "Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint and exits; --resume continues from the "
        "latest one.",
    )
    parser.add_argument("config", help="YAML recipe (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 trainer.max_steps=10")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUTPUT_DIR/checkpoints/latest (same config; data order, optimiser, RNG "
                             "and statistics are restored)")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="Python logging level (default WARNING: the progress bar carries the metrics)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from mmrlhf.config import ConfigError, load_config

    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("vllm").propagate = False  # vLLM logs through its own handler (VLLM_LOGGING_LEVEL)
    try:
        config = load_config(args.config, list(args.overrides))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mmrlhf.distributed.launch import resolve_backend

    try:
        backend = resolve_backend(config.distributed.backend)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if backend == "ray":
        from mmrlhf.distributed.ray.driver import run_ray

        return run_ray(config, resume=args.resume)
    if backend == "torchrun":
        from mmrlhf.distributed.torchrun import run_torchrun

        return run_torchrun(config, resume=args.resume)
    return train_and_report(config, resume=args.resume)


def runtime_user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user's data, rewards or settings can raise in the middle of a run: reported as one ``error:``
    line (they name the record, the source or the key), not a traceback."""
    from mmrlhf.data.errors import DataError
    from mmrlhf.experience.fast_maker import PromptMismatchError
    from mmrlhf.rewards.types import RewardError
    from mmrlhf.rollout.types import PromptTooLongError, RequestRejectedError
    from mmrlhf.trainer.checkpoint import CheckpointSpaceError

    return DataError, RewardError, PromptMismatchError, PromptTooLongError, RequestRejectedError, CheckpointSpaceError


def train_and_report(config: Any, *, resume: bool, dist: Any = None) -> int:
    """Build the trainer, train, print where the results are; the exit code of ``mmrlhf train`` (0 done, 1 stopped
    by non-finite updates, 2 misconfigured). ``dist``: this rank's context under torchrun (errors name the rank;
    only rank 0 writes ``config.yaml`` and the summary, which also says how many ranks trained)."""
    from mmrlhf.config import dump_config
    from mmrlhf.trainer.builder import build_trainer
    from mmrlhf.trainer.minibatch import NonFiniteError

    who = "" if dist is None else f" (rank {dist.rank})"
    main = dist is None or dist.is_main
    try:
        trainer = build_trainer(config, resume=resume, dist=dist)
    except (OSError, ValueError) as exc:  # config, output folder, checkpoint, model files: before training
        print(f"error{who}: {exc}", file=sys.stderr)
        return 2
    out = trainer.s.output_dir
    if main:
        with open(f"{out}/config.yaml", "w") as f:
            f.write(dump_config(config))
    try:
        with trainer.p.tracker:
            metrics = trainer.fit()
    except (NonFiniteError, *runtime_user_errors()) as exc:
        latest = trainer.p.checkpoints.latest()
        where = f"; the last checkpoint is {latest}" if latest is not None else ""
        print(f"error{who}: {exc}{where}", file=sys.stderr)
        return 1
    if not main:
        return 0
    latest = trainer.p.checkpoints.latest()
    reward = metrics.get("eval/reward/mean", metrics.get("reward/mean"))
    ranks = "" if dist is None else f" on {dist.world_size} ranks"
    print(f"done: step {trainer.state.step}{ranks}" + (f", reward {reward:.3f}" if reward is not None else ""))
    print(f"  curves:     {trainer.p.reporter.curves_path}")
    print(f"  report:     {trainer.p.reporter.report_path}")
    print(f"  checkpoint: {latest}")
    print(f"  metrics:    {out}/metrics.jsonl (TensorBoard: tensorboard --logdir {out}/tensorboard)")
    return 0
