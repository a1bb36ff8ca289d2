"""Load test of ``mmrlhf serve-reward`` (prints a Markdown table; not a test).

C concurrent clients (default 64), each sending one request (S samples) after another over its own kept-alive
connection for D seconds; then the requests in flight are drained. Reported per configuration: requests/s
(completed requests over the time from the first send to the last answer), latency p50 / p99, the slowest
``GET /health`` sampled every 0.2 s during the run, and the answers that were not 200 (503 = server full).

Configurations: a fast function (``exact_match``) and a 0.2 s synchronous function (sleeps, releasing the GIL, like
a rule waiting on I/O) with pools of 1, 8, 32 and 64 threads. The slow function must scale with the pool (about
threads / 0.2 s requests/s, until the clients run out: 64 clients / 0.2 s = 320/s), not serialise at 5/s.

Run:  python benchmarks/bench_reward_server.py [--clients 64] [--seconds 8] [--samples 4]
The load generator runs on the same (small) machine as the server: absolute numbers are modest, ratios hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SLOW_S = 0.2


def sleep_reward(responses, prompts, labels, references, delay=SLOW_S):
    """A slow synchronous rule (served from this file: ``benchmarks/bench_reward_server.py:sleep_reward``)."""
    time.sleep(delay)
    return [1.0 for _ in responses]


class Server:
    """``serve-reward`` in a subprocess; the URL comes from the line it prints once it accepts connections."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        argv = [sys.executable, "-m", "mmrlhf.cli.serve_reward", "--port", "0", *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        try:
            line = lines.get(timeout=180)
        except queue.Empty:
            line = ""
        if " on " not in line:
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f"server did not start: {line!r} {self.log.read()[-2000:]}")
        self.url = line.strip().rsplit(" on ", 1)[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


class Connection:
    """A kept-alive HTTP/1.1 connection speaking just enough HTTP for this test.

    Why not httpx: with 64 concurrent requests on one ``AsyncClient`` its connection pool, not the server, set the
    pace here (p99 of 5 s against 0.4 s with this client, for the same server).
    """

    def __init__(self, url: str) -> None:
        self.host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.port = int(port)
        self.reader = self.writer = None

    async def request(self, method: str, path: str, payload: bytes = b"") -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"{method} /{path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n")
        self.writer.write(head.encode() + payload)
        await self.writer.drain()
        lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        length = next(int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length:"))
        await self.reader.readexactly(length)
        return int(lines[0].split()[1])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def load(url: str, clients: int, seconds: float, samples: int) -> dict:
    body = {"responses": ["<answer>4</answer>"] * samples, "prompts": ["What is 2+2?"] * samples,
            "labels": ["math"] * samples, "references": ["4"] * samples}
    payload = json.dumps(body).encode()
    score_path, health_path = "score", "health"  # serve-reward's endpoints
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    health: list[float] = []
    connections = [Connection(url) for _ in range(clients + 1)]
    await asyncio.gather(*(c.request("POST", score_path, payload) for c in connections[:8]))  # warm-up
    start = time.perf_counter()
    stop_at = start + seconds
    last = [start]

    async def client(conn: Connection) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                status = await conn.request("POST", score_path, payload)
            except (OSError, asyncio.IncompleteReadError) as exc:  # counted, and a fresh connection next time
                status = type(exc).__name__
                conn.close()
                conn.writer = None
            t1 = time.perf_counter()
            if status == 200:
                latencies.append(t1 - t0)
            else:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            last[0] = max(last[0], t1)

    async def prober(conn: Connection) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await conn.request("GET", health_path)
            health.append(time.perf_counter() - t0)
            await asyncio.sleep(0.2)

    try:
        await asyncio.gather(prober(connections[-1]), *(client(c) for c in connections[:-1]))
    finally:
        for conn in connections:
            conn.close()
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {
        "done": len(latencies),
        "rps": len(latencies) / (last[0] - start),
        "p50": statistics.median(latencies),
        "p99": pick(0.99),
        "health": max(health) if health else float("nan"),
        "other": statuses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=8.0, help="sending time per configuration")
    ap.add_argument("--samples", type=int, default=4, help="samples per request")
    ap.add_argument("--threads", default="1,8,32,64", help="pool sizes for the slow function ('': fast only)")
    ap.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = ap.parse_args()

    slow = f"{Path(__file__).resolve()}:sleep_reward"
    configs = [("fast (`exact_match`)", "exact_match", 8)]
    configs += [(f"{SLOW_S} s sync sleep", slow, int(t)) for t in args.threads.split(",") if t]
    print(f"{args.clients} concurrent clients, {args.samples} samples per request, {args.seconds:g} s of sending "
          f"per row; {os.cpu_count()} CPU cores shared by server and load generator\n")
    print("| reward | pool threads | requests | requests/s | p50 ms | p99 ms | slowest /health ms | not 200 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    rows = []
    for label, spec, threads in configs:
        server = Server("--reward", spec, "--threads", str(threads), "--max-concurrent", str(args.clients))
        try:
            r = asyncio.run(load(server.url, args.clients, args.seconds, args.samples))
        finally:
            server.stop()
        other = ", ".join(f"{k}: {v}" for k, v in sorted(r["other"].items())) or "-"  # e.g. 503 (full)
        print(f"| {label} | {threads} | {r['done']} | {r['rps']:.1f} | {r['p50'] * 1e3:.0f} | "
              f"{r['p99'] * 1e3:.0f} | {r['health'] * 1e3:.0f} | {other} |", flush=True)
        ideal = min(threads, args.clients) / SLOW_S if spec != "exact_match" else None
        rows.append([label, threads, r["done"], r["rps"], r["p50"] * 1e3, r["p99"] * 1e3, r["health"] * 1e3,
                     other, 100 * r["rps"] / ideal if ideal else None])
    print(f"\nideal for the slow function: min(threads, clients) / {SLOW_S} s requests/s")
    if args.json:
        from _results import table, write_json

        fast = rows[0]
        headline = (f"fast function {fast[3]:.0f} requests/s, p50 {fast[4]:.0f} ms / p99 {fast[5]:.0f} ms with "
                    f"{args.clients} clients")
        if len(rows) > 1:
            headline += f"; {SLOW_S} s function at {rows[-1][1]} threads: {rows[-1][8]:.0f}% of ideal"
        write_json(args.json, "reward_server", headline,
                   {"clients": args.clients, "seconds": args.seconds, "samples_per_request": args.samples},
                   [table(f"{args.clients} concurrent clients; ideal for the slow function = min(threads, clients) / "
                          f"{SLOW_S} s", ["reward", "pool threads", "requests", "requests/s", "p50 ms", "p99 ms",
                                          "slowest /health ms", "not 200", "% of ideal"], rows)])


if __name__ == "__main__":
    main()
