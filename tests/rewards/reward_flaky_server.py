"""A real reward server (``build_app`` + uvicorn) that answers 503 to every other request. Test helper.

Usage: python serve_flaky.py  -> prints ``serving flaky on http://127.0.0.1:PORT/score``.
"""

import socket
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

from reward_test_plugins import echo_number  # noqa: E402

from mmrlhf.rewards.server import build_app  # noqa: E402
from mmrlhf.rewards.sources import FunctionSource  # noqa: E402


def flaky(app):
    count = {"n": 0}

    async def wrapped(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/score":
            count["n"] += 1
            if count["n"] % 2 == 1:
                headers = [(b"content-type", b"text/plain")]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": b"flaky: try again"})
                return
        await app(scope, receive, send)

    return wrapped


if __name__ == "__main__":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = flaky(build_app(FunctionSource(echo_number).score, name="flaky"))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    print(f"serving flaky on http://127.0.0.1:{sock.getsockname()[1]}/score", flush=True)
    server.run(sockets=[sock])
