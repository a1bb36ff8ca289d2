"""Helpers for the reward tests: helper plugin paths and real reward-server subprocesses on 127.0.0.1.

(A uniquely named module, not conftest.py: importing it cannot pick up another test folder's conftest.)
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGINS = HERE / "reward_test_plugins.py"
START_TIMEOUT_S = 120.0  # a server starting on a loaded 2-core machine can take many seconds


def plugin(name: str) -> str:
    """The ``file.py:function`` spec of a helper reward function."""
    return f"{PLUGINS}:{name}"


class ServerProcess:
    """A reward server subprocess; ``url`` is read from the line it prints once listening.

    stderr goes to a file, not a pipe: a pipe nobody reads would block a chatty server once it fills.
    """

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        try:
            first = lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            first = ""
        if " on " not in first:
            self.stop()
            raise RuntimeError(f"reward server did not start (first line {first!r}); stderr: {self.errors()}")
        self.url = first.strip().rsplit(" on ", 1)[1]
        self.health_url = self.url.rsplit("/", 1)[0] + "/health"
        self.host, port = self.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.port = int(port)

    def errors(self) -> str:
        """The tail of the server's stderr."""
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def serve(*args: str) -> ServerProcess:
    """Start ``mmrlhf serve-reward`` (this module alone, so other subcommands' imports do not matter) on a free port
    (``--port 0``, unless ``args`` names one)."""
    return ServerProcess([sys.executable, "-m", "mmrlhf.cli.serve_reward", "--port", "0", *args])
