"""serve-reward under load, started for real on 127.0.0.1: readiness, a bounded pool, a concurrency limit, request
timeouts, what /health tells, references as sent, and a client riding out a restart.

Timing checks are ratios against the serial time, with wide margins (the machine is small and shared)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from reward_testing import plugin, serve

from mmrlhf.rewards import FunctionSource, RemoteRewardClient, RewardBatch, RewardComputationEngine
from mmrlhf.rewards.functions import load_reward_function
from mmrlhf.rewards.sources import ClientSource

TOKEN = "s3cret-token"


def body(values) -> dict:
    n = len(values)
    return {"responses": [str(v) for v in values], "prompts": [""] * n, "labels": ["a"] * n, "references": [None] * n}


def test_the_serving_line_comes_only_once_connections_are_accepted():
    server = serve("--reward", plugin("echo_number"))
    try:
        with socket.create_connection((server.host, server.port), timeout=10):  # at once: no retry, no wait
            pass
    finally:
        server.stop()


def test_a_slow_sync_function_runs_in_the_pool_and_health_stays_fast():
    delay, n = 0.5, 16
    server = serve("--reward", plugin("sleep_echo"), "--options", f'{{"delay": {delay}}}', "--threads", str(n))
    try:
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                started = time.monotonic()
                load = [asyncio.ensure_future(client.post(server.url, json=body([k]))) for k in range(n)]
                await asyncio.sleep(0.05)
                health_start = time.monotonic()
                health = await client.get(server.health_url)
                health_s = time.monotonic() - health_start
                answers = await asyncio.gather(*load)
                return answers, time.monotonic() - started, health, health_s

        answers, elapsed, health, health_s = asyncio.run(run())
    finally:
        server.stop()
    assert [a.json()["scores"] for a in answers] == [[float(k)] for k in range(n)]
    serial = n * delay  # 8 s if the requests were served one after another
    assert elapsed < serial / 2, f"{n} concurrent {delay} s calls took {elapsed:.2f} s (serial: {serial} s)"
    assert health.status_code == 200 and health_s < serial / 4, f"/health took {health_s:.2f} s under load"


def test_a_full_server_answers_503_with_retry_after_and_a_slow_request_gets_504():
    server = serve("--reward", plugin("sleep_echo"), "--options", '{"delay": 5.0}', "--threads", "2",
                   "--max-concurrent", "2", "--request-timeout-s", "1")
    try:
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(server.url, json=body([k])) for k in range(6)))

        answers = asyncio.run(run())
        codes = [a.status_code for a in answers]
        # Two are taken (and time out); the others arrive while both slots are held and are turned away at once
        # (one arriving over 1 s late on a loaded machine would be taken, and time out too).
        assert set(codes) == {503, 504} and codes.count(504) >= 2, codes
        for a in answers:
            if a.status_code == 503:
                assert a.headers.get("retry-after") == "1" and "busy" in a.json()["detail"]
            else:
                assert "did not finish within 1 s" in a.json()["detail"]
        health = httpx.get(server.health_url, timeout=30).json()
        assert health["in_flight"] == 0 and health["max_concurrent"] == 2
        # the server carries on: the pool's two threads are still sleeping, the next request waits for one
        assert httpx.post(server.url, json=body([7]), timeout=60).status_code in (200, 504)
    finally:
        server.stop()


def test_health_names_the_reward_only_to_token_holders(echo_server):
    anonymous = httpx.get(echo_server.health_url, timeout=30)
    assert anonymous.status_code == 200 and anonymous.json()["status"] == "ok"
    assert "reward" not in anonymous.json() and "reward_test_plugins" not in anonymous.text
    holder = httpx.get(echo_server.health_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert holder.json()["reward"] == plugin("echo_number")


def test_references_reach_a_served_function_as_a_local_one_gets_them():
    refs = [3, 2.5, "3", None, [1, 2], {"a": 1}, True]
    batch = RewardBatch(responses=["x"] * len(refs), prompts=[""] * len(refs), labels=["a"] * len(refs),
                        references=refs)
    server = serve("--reward", plugin("reference_kind"))
    try:
        sources = {
            "remote": ClientSource(RemoteRewardClient(server.url, batch_size=3), name="remote"),
            "local": FunctionSource(load_reward_function(plugin("reference_kind")), name="local"),
        }
        engine = RewardComputationEngine(sources, {"a": [("remote", 1.0), ("local", 100.0)]}, on_failure="mask")
        result = engine.compute(batch)
    finally:
        server.stop()
    assert result.valid.all() and result.metrics["reward/failed_samples"] == 0.0
    assert result.sources["remote"].tolist() == [1.0, 2.0, 3.0, 0.0, 4.0, 5.0, 6.0]
    assert result.sources["remote"].tolist() == result.sources["local"].tolist()


@pytest.mark.slow
def test_a_client_with_default_retries_rides_out_a_server_restart():
    server = serve("--reward", plugin("echo_number"))
    port = server.port
    client = RemoteRewardClient(server.url, batch_size=2, max_concurrency=2, seed=0)  # default retry settings
    assert asyncio.run(client.score(RewardBatch(["1"], [""], ["a"], [None]))).scores == [1.0]
    server.stop()
    restarted: dict = {}

    def restart():  # the client is already failing to connect while the new server starts
        time.sleep(0.5)
        started = time.monotonic()
        restarted["server"] = serve("--reward", plugin("echo_number"), "--port", str(port))
        restarted["took"] = time.monotonic() - started

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        numbers = list(range(10))
        res = asyncio.run(client.score(RewardBatch([str(x) for x in numbers], [""] * 10, ["a"] * 10, [None] * 10)))
        assert res.scores == [float(x) for x in numbers]
        assert client.requests_sent > 1 + 5  # the first call, 5 requests, and retries while the server was down
    finally:
        thread.join()
        if "server" in restarted:
            restarted["server"].stop()
