"""A stand-in OpenAI-compatible judge: answers every ``POST .../chat/completions`` with one fixed verdict after a
fixed delay, over kept-alive HTTP/1.1, in a subprocess of its own.

Why: the judge client's own cost and its metrics (``latency_s``, ``queue_s``) need a server whose time is known by
construction (instant, or a sleep of exactly ``delay_s``) and that costs the client's process nothing: a model
(even a tiny ``vllm serve``) answers in tens of milliseconds with a spread, and a server in a thread of the
client's process would take the client's GIL. The server reads and parses each body (a real server would) and
counts the requests and the most it held at once since the last ``GET /stats`` (which reads and resets them), so
a test can check the client's concurrency.

    with FakeJudgeServer(delay_s=0.05) as server:
        EndpointJudge(server.base_url, "fake", ...)

Run alone: ``python -m mmrlhf.testing.judge_server --delay-ms 50`` prints ``serving on http://127.0.0.1:PORT/v1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any

ANSWER = {"id": "fake", "object": "chat.completion", "model": "fake-judge",
          "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "yes"},
                       "logprobs": {"content": [{"token": "yes", "logprob": -0.1, "top_logprobs": [
                           {"token": "yes", "logprob": -0.1}, {"token": "no", "logprob": -2.4}]}]}}]}


class _Handler:
    """One server's state: the delay, the fixed answer, and the counts ``/stats`` reports."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.answer = json.dumps(ANSWER).encode()
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
                fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
                body = await reader.readexactly(int(fields.get("content-length", "0")))
                status, payload = await self._answer(method, path, body)
                close = fields.get("connection", "").lower() == "close"
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
                             f"\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n".encode() + payload)
                await writer.drain()
                if close:
                    return
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[str, bytes]:
        if method == "GET" and path.endswith("/stats"):  # read and reset: each check counts from the last one
            stats = {"requests": self.requests, "max_in_flight": self.max_in_flight}
            self.requests, self.max_in_flight = 0, self.in_flight
            return "200 OK", json.dumps(stats).encode()
        if method != "POST" or not path.endswith("/chat/completions"):
            return "404 Not Found", b'{"error": "not found"}'
        try:
            json.loads(body)
        except ValueError:
            return "400 Bad Request", b'{"error": "body is not JSON"}'
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s > 0:
                await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        return "200 OK", self.answer


async def serve(port: int, delay_s: float) -> None:
    handler = _Handler(delay_s)
    server = await asyncio.start_server(handler.connection, "127.0.0.1", port, backlog=1024)
    print(f"serving on http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", flush=True)
    async with server:
        await server.serve_forever()


class FakeJudgeServer:
    """The server in a subprocess (stopped on exit of the ``with`` block); ``base_url`` ends in ``/v1``."""

    def __init__(self, delay_s: float = 0.0, start_timeout_s: float = 60.0) -> None:
        argv = [sys.executable, "-m", "mmrlhf.testing.judge_server", "--port", "0", "--delay-ms",
                str(delay_s * 1000.0)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ,
                                                                                      PYTHONUNBUFFERED="1"))
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=start_timeout_s)
        except queue.Empty:
            line = ""
        if not line.startswith("serving on "):
            self.stop()
            raise RuntimeError(f"the fake judge server did not start (exit status {self.proc.returncode}): {line!r}")
        self.base_url = line.split("serving on ", 1)[1].strip()

    def stats(self) -> dict[str, Any]:
        """Requests answered and the most held at once since the last call (or the start)."""
        import httpx

        return httpx.get(self.base_url + "/stats", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def __enter__(self) -> "FakeJudgeServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="a fake OpenAI-compatible judge answering 'yes' after a fixed delay")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    asyncio.run(serve(args.port, args.delay_ms / 1000.0))


if __name__ == "__main__":
    main()
