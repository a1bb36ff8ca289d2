"""``mmrlhf config show CONFIG [key=value ...]``: print the resolved, validated config as YAML; with ``--plan``, the
run's GPU memory plan instead (:mod:`mmrlhf.models.memory`)."""

from __future__ import annotations

import argparse
import sys

from mmrlhf.config import ConfigError, dump_config, load_config


def config_sections() -> list[str]:
    """The config's top-level sections, in schema order (the help text lists them)."""
    from mmrlhf.config import MMRLHFConfig

    return list(MMRLHFConfig.model_fields)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "config",
        help="inspect configurations",
        description="Inspect configurations. Configs are YAML files of sections ("
        f"{', '.join(config_sections())}); any key can be overridden on the command line as section.key=value.",
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
    show.add_argument("--plan", action="store_true",
                      help="print the GPU memory plan instead of the config: GiB of weights, gradients, AdamW "
                      "moments, the vLLM engine's share and the largest micro-batch's activations, per phase, per GPU "
                      "and per launch mode, whether it fits and which key makes it fit")
    show.add_argument("--shape", metavar="NAME", help="plan for a named model shape instead of model.pretrain's "
                      "config.json (" + ", ".join(_shape_names()) + ")")
    show.add_argument("--teacher-shape", metavar="NAME", help="with --plan and distillation: plan for a teacher of "
                      "a named shape instead of model.teacher's config.json")
    show.add_argument("--gpu-memory", metavar="GIB", type=float, default=None,
                      help="memory of one GPU in GiB (default: the visible GPU's, else 80)")
    show.add_argument("--ranks", metavar="N", type=int, default=None,
                      help="with --plan: torchrun world size over all nodes, for distributed.backend=torchrun "
                      "(default: WORLD_SIZE, else 8)")
    show.add_argument("--gpus-per-node", metavar="N", type=int, default=None,
                      help="with --plan: GPUs of one node (default 8); an engine's "
                      "tensor-parallel group sits on one node, and offload's host memory is summed per node")
    show.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    show.set_defaults(func=_show)
    docs = actions.add_parser(
        "docs",
        help="print the configuration reference (Markdown) generated from the schema",
        description="Print docs/configuration.md: every key with its type, default, bounds and description.",
    )
    docs.set_defaults(func=_docs)


def _shape_names() -> list[str]:
    from mmrlhf.models.shapes import shape_names

    return shape_names()


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
    if args.plan:
        return _plan(args, config, path)
    if (args.shape or args.teacher_shape or args.json or args.gpu_memory is not None or args.ranks is not None
            or args.gpus_per_node is not None):
        print("error: --shape, --teacher-shape, --gpu-memory, --ranks, --gpus-per-node and --json go with --plan",
              file=sys.stderr)
        return 2
    sys.stdout.write(dump_config(config))
    return 0


def _plan(args: argparse.Namespace, config, path: str | None) -> int:
    import json

    from mmrlhf.models.memory.advice import memory_plan, to_json
    from mmrlhf.models.memory.inputs import PlanError
    from mmrlhf.models.memory.render import render_text

    try:
        plan = memory_plan(config, shape=args.shape, gpu_gib=args.gpu_memory, ranks=args.ranks,
                           teacher_shape=args.teacher_shape, gpus_per_node=args.gpus_per_node)
    except (PlanError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(json.dumps(to_json(plan), indent=1) + "\n")
    else:
        sys.stdout.write(render_text(plan, title=" ".join([path or "defaults", *args.overrides])))
    return 0
