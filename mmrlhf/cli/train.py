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
    from mmrlhf.startup import defer_full_collections

    defer_full_collections()  # until the trainer is built (mmrlhf.startup)
    from mmrlhf.config import ConfigError, load_config

    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("vllm").propagate = False  # vLLM logs through its own handler (VLLM_LOGGING_LEVEL)
    try:
        config = load_config(args.config, list(args.overrides))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mmrlhf.launch import run

    return run(config, resume=args.resume)
