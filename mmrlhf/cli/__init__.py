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
    "mmrlhf.cli.doctor",
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


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; dotted overrides may also come after the options (``train x.yaml --resume key=value``):
    argparse stops filling a positional list at the first option, so such trailing ``key=value`` words are
    appended to the command's overrides. Anything else unknown is still an error."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
