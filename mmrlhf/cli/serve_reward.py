"""``mmrlhf serve-reward --reward SPEC [--host 127.0.0.1] [--port N] [--token-file F]``: serve a reward over HTTP.

SPEC is a reward function (built-in name, ``package.module:fn`` or ``path/to/file.py:fn``); ``--reward-model KIND
--model-path DIR`` serves a local reward model instead (it tokenizes text + images with the processor in DIR).
The server binds to loopback unless told otherwise, and refuses to listen on another address without a token.
Once it accepts connections (not before) it prints one line ``serving <name> on http://HOST:PORT/score`` (port 0
picks a free port, and this line says which), which scripts and tests wait for.

A synchronous reward function runs in a pool of ``--threads`` threads (it must be thread-safe when that is over 1);
a reward model stays on its device and scores the requests that arrive while it is busy together, as one batch.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import sys
from typing import Sequence


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve-reward",
        help="serve a reward function or reward model over HTTP",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--reward", metavar="SPEC", help="reward function: built-in name, module:fn or file.py:fn")
    what.add_argument("--reward-model", metavar="KIND", help="reward model kind (e.g. qwen_vl_scalar, module:factory)")
    parser.add_argument("--model-path", default="", help="checkpoint directory for --reward-model")
    parser.add_argument("--options", default="{}", help="JSON object of keyword options for the function / builder")
    parser.add_argument("--device", default="auto", help="device for --reward-model (default: auto)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: pick a free one; default 8000)")
    parser.add_argument("--token-file", default="", help="file with the bearer token clients must send")
    parser.add_argument(
        "--insecure-no-token", action="store_true", help="allow a non-loopback --host without --token-file"
    )
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted (MiB)")
    parser.add_argument("--max-batch", type=int, default=1024, help="most samples per request")
    parser.add_argument("--max-image-mb", type=float, default=8.0, help="largest single image accepted (MiB)")
    parser.add_argument(
        "--threads", type=int, default=8, help="threads running a synchronous reward function (default 8)"
    )
    parser.add_argument(
        "--max-concurrent", type=int, default=64,
        help="requests decoded and scored at once; one more is answered 503 with Retry-After (default 64)",
    )
    parser.add_argument(
        "--request-timeout-s", type=float, default=50.0,
        help="a request scoring longer is answered 504; keep it under the client's timeout_s (default 50)",
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=8, help="samples per forward pass of --reward-model (default 8)"
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from mmrlhf.rewards.remote import read_token
    from mmrlhf.rewards.types import RewardError
    from mmrlhf.rewards.wire import ServerLimits

    try:
        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        print(f"error: --options must be a JSON object: {exc}", file=sys.stderr)
        return 2
    if not _is_loopback(args.host) and not args.token_file and not args.insecure_no_token:
        print(
            f"error: refusing to serve on non-loopback address {args.host} without --token-file "
            "(pass --insecure-no-token to override)",
            file=sys.stderr,
        )
        return 2
    for flag, value in (("--threads", args.threads), ("--max-concurrent", args.max_concurrent),
                        ("--micro-batch-size", args.micro_batch_size), ("--max-batch", args.max_batch)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.request_timeout_s <= 0:
        print(f"error: --request-timeout-s must be > 0, got {args.request_timeout_s}", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file) if args.token_file else None
        scorer, name = _build_scorer(args, options)
    except (RewardError, KeyError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    limits = ServerLimits(
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_batch=args.max_batch,
        max_image_bytes=int(args.max_image_mb * 1024 * 1024),
        max_concurrent_requests=args.max_concurrent,
        request_timeout_s=args.request_timeout_s,
    )
    return _serve(scorer, name, token, limits, args.host, args.port, args.log_level)


def _build_scorer(args: argparse.Namespace, options: dict):
    if args.reward:
        from concurrent.futures import ThreadPoolExecutor

        from mmrlhf.rewards.functions import load_reward_function
        from mmrlhf.rewards.sources import FunctionSource

        fn = load_reward_function(args.reward)
        pool = ThreadPoolExecutor(args.threads, thread_name_prefix="reward-fn")
        source = FunctionSource(fn, name=args.reward, options=options, executor=pool)
        return source.score, args.reward
    from mmrlhf.rewards.coalesce import CoalescingScorer
    from mmrlhf.rewards.text_model import load_text_reward_model

    model = load_text_reward_model(
        args.reward_model, args.model_path, device=args.device, micro_batch_size=args.micro_batch_size, **options
    )
    return CoalescingScorer(model.score, max_samples=args.max_batch), args.reward_model


def _serve(scorer, name: str, token: str | None, limits, host: str, port: int, log_level: str) -> int:
    import uvicorn

    from mmrlhf.rewards.server import build_app

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"error: cannot bind {host}:{port}: {exc}", file=sys.stderr)
        sock.close()
        return 2
    bound_port = sock.getsockname()[1]
    app = build_app(scorer, token=token, limits=limits, name=name)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    announce = f"serving {name} on http://{shown}:{bound_port}/score"

    class AnnouncingServer(uvicorn.Server):
        """Prints the "serving" line once startup is complete: the socket listens and connections are accepted."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(announce, flush=True)

    server = AnnouncingServer(uvicorn.Config(app, log_level=log_level, access_log=False))
    server.run(sockets=[sock])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run this command alone (without the other subcommands' imports): ``python -m mmrlhf.cli.serve_reward``."""
    parser = argparse.ArgumentParser(prog="mmrlhf serve-reward", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
