"""``mmrlhf train CONFIG [section.key=value ...] [--resume]``: run GRPO / PPO training from a recipe."""

from __future__ import annotations

import argparse
import logging
import sys


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train a policy with GRPO / PPO from a YAML recipe",
        description="Load CONFIG, apply the dotted overrides (section.key=value), build the models, the rollout "
        "engine, the rewards and the trainer, and train for trainer.max_steps rollout steps. Metrics go to "
        "OUTPUT_DIR/metrics.jsonl and TensorBoard; curves.png, report.html and checkpoints/ are written there too. "
        "Ctrl-C finishes the current step, saves a checkpoint and exits; --resume continues from the latest one.",
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
    from mmrlhf.config import ConfigError, dump_config, load_config

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
    from mmrlhf.trainer.builder import build_trainer

    try:
        trainer = build_trainer(config, resume=args.resume)
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = trainer.s.output_dir
    with open(f"{out}/config.yaml", "w") as f:
        f.write(dump_config(config))
    from mmrlhf.trainer.minibatch import NonFiniteError

    try:
        with trainer.p.tracker:
            metrics = trainer.fit()
    except NonFiniteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    latest = trainer.p.checkpoints.latest()
    reward = metrics.get("eval/reward/mean", metrics.get("reward/mean"))
    print(f"done: step {trainer.state.step}" + (f", reward {reward:.3f}" if reward is not None else ""))
    print(f"  curves:     {trainer.p.reporter.curves_path}")
    print(f"  report:     {trainer.p.reporter.report_path}")
    print(f"  checkpoint: {latest}")
    print(f"  metrics:    {out}/metrics.jsonl (TensorBoard: tensorboard --logdir {out}/tensorboard)")
    return 0
