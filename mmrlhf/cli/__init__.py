"""The ``mmrlhf`` command. Each subcommand lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` (called with the parsed namespace; returns an exit code)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# Subcommand modules, in the order ``--help`` lists them. Add a line to add a command.
COMMANDS = [
    "mmrlhf.cli.config_cmd",
    "mmrlhf.cli.train",
    "mmrlhf.cli.smoke",
    "mmrlhf.cli.serve_reward",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmrlhf",
        description="Reinforcement-learning fine-tuning of vision-language models (GRPO, PPO, ...).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
