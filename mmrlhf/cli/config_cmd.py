"""``mmrlhf config show CONFIG [key=value ...]``: print the resolved, validated config as YAML."""

from __future__ import annotations

import argparse
import sys

from mmrlhf.config import ConfigError, dump_config, load_config


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "config",
        help="inspect configurations",
        description="Inspect configurations. Configs are YAML files of sections (model, data, rollout, reward, "
        "algorithm, trainer); any key can be overridden on the command line as section.key=value.",
    )
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print the resolved config (file + overrides, validated, defaults filled in)",
        description="Load CONFIG (or only defaults if omitted), apply the dotted overrides, validate, and print "
        "the result as YAML. Invalid keys or values are reported with the key's name and the allowed values.",
    )
    show.add_argument("config", nargs="?", help="YAML config file (optional: defaults only)")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 rollout.engine=vllm")
    show.set_defaults(func=_show)
    docs = actions.add_parser(
        "docs",
        help="print the configuration reference (Markdown) generated from the schema",
        description="Print docs/configuration.md: every key with its type, default, bounds and description.",
    )
    docs.set_defaults(func=_docs)


def _docs(args: argparse.Namespace) -> int:
    from mmrlhf.config.reference import render_reference

    sys.stdout.write(render_reference())
    return 0


def _show(args: argparse.Namespace) -> int:
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:  # only overrides were given
        path, overrides = None, [path, *overrides]
    try:
        config = load_config(path, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_config(config))
    return 0
