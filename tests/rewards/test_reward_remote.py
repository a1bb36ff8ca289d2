"""The reward server started for real on 127.0.0.1 and exercised by the client (and raw HTTP for bad requests)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import sys
import time

import httpx
import pytest
from reward_testing import HERE, ServerProcess, plugin, serve
from PIL import Image

from mmrlhf.config import build_config
from mmrlhf.rewards import RewardBatch, RewardComputationEngine
from mmrlhf.rewards.remote import RemoteRewardClient, RemoteRewardError

TOKEN = "s3cret-token"


def batch_of(numbers, labels=None, images=None) -> RewardBatch:
    n = len(numbers)
    return RewardBatch(
        responses=[str(x) for x in numbers],
        prompts=[f"prompt {x}" for x in numbers],
        labels=labels or ["a"] * n,
        references=[None] * n,
        images=images,
    )


def client(url, **kw) -> RemoteRewardClient:
    defaults = dict(token=TOKEN, timeout_s=10, max_retries=2, backoff_s=0.02, backoff_max_s=0.1, seed=0)
    return RemoteRewardClient(url, **{**defaults, **kw})


def test_64_concurrent_batched_requests_all_answered_and_aligned(echo_server):
    c = client(echo_server.url, batch_size=3, max_concurrency=16)
    batches = [batch_of([1000 * k + j for j in range(7)]) for k in range(64)]  # 64 calls x 3 requests each

    async def run_all():
        return await asyncio.gather(*(c.score(b) for b in batches))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for k, res in enumerate(results):
        assert res.scores == [float(1000 * k + j) for j in range(7)]
        assert res.errors == [None] * 7
    # Up to 64 x 3 requests arrive at once; the server takes 64 and answers the rest 503 + Retry-After, which the
    # client honours and retries, so every chunk is sent at least once and some more than once.
    assert c.requests_sent >= 64 * 3


def test_one_large_batch_is_split_and_reassembled_in_order(echo_server):
    numbers = list(range(500, 0, -1))
    c = client(echo_server.url, batch_size=8, max_concurrency=64)
    res = asyncio.run(c.score(batch_of(numbers)))
    assert res.scores == [float(x) for x in numbers]
    assert c.requests_sent == 63


def test_request_without_token_or_with_a_wrong_one_is_refused(echo_server):
    body = {"responses": ["1"], "prompts": [""], "labels": ["a"], "references": [None]}
    assert httpx.post(echo_server.url, json=body, timeout=10).status_code == 401
    wrong = httpx.post(echo_server.url, json=body, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    ok = httpx.post(echo_server.url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["scores"] == [1.0]
    with pytest.raises(RemoteRewardError, match="401"):
        asyncio.run(client(echo_server.url, token=None).score(batch_of([1])))


def _body(**changes) -> str:
    return json.dumps({"responses": ["1"], "prompts": [""], "labels": ["a"], "references": [None], **changes})


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 422, "Invalid JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 422, "object"),
        (_body(responses=["1", "2"], labels=["x", "y"], references=[None, None]), 422, "'prompts' has 1 entries"),
        (_body(responses=[1]), 422, "responses"),
        (_body(bogus=1), 422, "bogus"),
        (_body(responses=["x" * 2_000_000]), 413, "exceeds"),
    ],
)
def test_malformed_and_oversized_bodies_get_4xx_with_a_message(echo_server, body, status, words):
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    r = httpx.post(echo_server.url, content=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    assert words in r.json()["detail"]
    # and the server is still alive afterwards
    assert httpx.get(echo_server.url.replace("/score", "/health"), timeout=10).status_code == 200


def test_a_scoring_failure_is_reported_per_sample_not_as_a_crash(echo_server):
    c = client(echo_server.url, batch_size=4)
    res = asyncio.run(c.score(batch_of(["1", "two", "3"])))
    assert res.scores == [1.0, None, 3.0]
    assert res.errors[0] is None and res.errors[2] is None
    assert "sample 1" in res.errors[1] and echo_server.url in res.errors[1]


def _png_b64(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_images_travel_as_base64_and_the_size_cap_is_enforced():
    server = serve("--reward", plugin("image_widths"), "--max-image-mb", "0.01")
    try:
        images = [[Image.new("RGB", (5, 4))], [], [Image.new("RGB", (7, 3)), Image.new("RGB", (11, 2))]]
        res = asyncio.run(client(server.url, token=None).score(batch_of([1, 2, 3], images=images)))
        assert res.scores == [5.0, 0.0, 18.0]
        base = {"responses": ["1"], "prompts": [""], "labels": ["a"], "references": [None]}
        noise = Image.frombytes("RGB", (128, 128), random.Random(0).randbytes(128 * 128 * 3))  # ~48 KiB as PNG
        big = io.BytesIO()
        noise.save(big, format="PNG")
        cases = [
            ([[base64.b64encode(big.getvalue()).decode()]], 413, "exceeds"),
            ([["!!notbase64!!"]], 422, "base64"),
            ([[base64.b64encode(b"GIF89a not an image").decode()]], 422, "cannot decode"),
        ]
        for imgs, status, words in cases:
            r = httpx.post(server.url, json={**base, "images": imgs}, timeout=10)
            assert r.status_code == status and words in r.json()["detail"] and "sample 0 image 0" in r.json()["detail"]
    finally:
        server.stop()


def test_server_killed_mid_run_client_retries_then_fails_naming_the_url():
    server = serve("--reward", plugin("slow_echo"))
    c = client(server.url, token=None, batch_size=1, max_concurrency=1, max_retries=3, timeout_s=5)

    async def run():
        task = asyncio.ensure_future(c.score(batch_of(list(range(200)))))
        while c.requests_sent < 3:  # let a few requests succeed first (bounded by the 0.1 s server delay)
            await asyncio.sleep(0.05)
        server.stop()
        started = time.monotonic()
        with pytest.raises(RemoteRewardError) as info:
            await asyncio.wait_for(task, timeout=30)
        return info.value, time.monotonic() - started

    error, waited = asyncio.run(run())
    assert server.url in str(error) and "after 4 attempts" in str(error)
    assert waited < 30
    done_before_kill = 3
    assert c.requests_sent >= done_before_kill + 4  # the failing chunk was tried 1 + max_retries times


def test_flaky_server_still_yields_complete_correctly_ordered_scores():
    server = ServerProcess([sys.executable, str(HERE / "reward_flaky_server.py")])
    try:
        numbers = [7, 3, 9, 1, 8, 2, 6, 4, 5, 0, 11, 10]
        c = client(server.url, token=None, batch_size=2, max_concurrency=3, max_retries=4)
        res = asyncio.run(c.score(batch_of(numbers)))
        assert res.scores == [float(x) for x in numbers]
        assert c.requests_sent >= 2 * 6 - 1  # about every other request was refused and retried
    finally:
        server.stop()


def test_engine_uses_the_remote_source_only_for_its_labels(echo_server, token_file):
    cfg = build_config(
        {
            "reward": {
                "label_map": {
                    "remote": {
                        "type": "remote", "url": echo_server.url, "token_file": str(token_file), "batch_size": 2,
                    },
                    "len": plugin("async_len"),
                },
                "recipe": {"num": [["remote", 2.0]], "text": [["len", 1.0]]},
            }
        }
    ).reward
    engine = RewardComputationEngine.from_config(cfg)
    batch = RewardBatch(
        responses=["5", "hello", "7", "hi", "1"],
        prompts=[""] * 5,
        labels=["num", "text", "num", "text", "num"],
        references=[None] * 5,
    )
    result = engine.compute(batch)
    assert result.rewards.tolist() == [10.0, 5.0, 14.0, 2.0, 2.0]
    assert engine.sources["remote"].client.requests_sent == 2  # 3 "num" samples in requests of 2


def test_down_server_fails_fast_with_the_url_after_bounded_retries():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    c = client(url, max_retries=2)
    with pytest.raises(RemoteRewardError, match=f"{url}.*after 3 attempts"):
        asyncio.run(c.score(batch_of([1, 2, 3])))
    assert c.requests_sent == 3


def test_backoff_grows_exponentially_with_bounded_jitter():
    c = RemoteRewardClient("http://127.0.0.1:1/score", backoff_s=1.0, backoff_max_s=5.0, seed=1)
    for attempt, full in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 5.0), (6, 5.0)]:
        delays = [c.backoff_delay(attempt) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays)
        assert max(delays) - min(delays) > 0  # jittered, not fixed


@pytest.mark.slow
def test_serve_reward_model_scores_text_and_images_over_http():
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir("qwen2_vl", "tiny", seed=0)
    server = serve(
        "--reward-model", "qwen_vl_scalar", "--model-path", str(path), "--options", '{"allow_random_head": true}',
        "--device", "cpu",
    )
    try:
        img = "<|vision_start|><|image_pad|><|vision_end|>"
        batch = RewardBatch(
            responses=["red", "blue", "red"], prompts=[f"{img}What color?", "Say a colour.", f"{img}What color?"],
            labels=["a"] * 3, references=[None] * 3,
            images=[[Image.new("RGB", (56, 56), "red")], [], [Image.new("RGB", (56, 56), "red")]],
        )
        res = asyncio.run(client(server.url, token=None, batch_size=2).score(batch))
        assert all(isinstance(s, float) for s in res.scores) and res.errors == [None] * 3
        assert res.scores[0] == pytest.approx(res.scores[2], abs=1e-4)  # same sample, different requests
        assert res.scores[0] != pytest.approx(res.scores[1], abs=1e-6)
    finally:
        server.stop()


def test_client_keeps_to_its_concurrency_limit_and_rejects_misaligned_answers():
    state = {"active": 0, "most": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        state["active"] += 1
        state["most"] = max(state["most"], state["active"])
        await asyncio.sleep(0.01)
        state["active"] -= 1
        return httpx.Response(200, json={"scores": [float(r) for r in body["responses"]]})

    c = client("http://scorer.test/score", batch_size=2, max_concurrency=3, transport=httpx.MockTransport(handler))
    res = asyncio.run(c.score(batch_of(list(range(40)))))
    assert res.scores == [float(x) for x in range(40)]
    assert state["most"] == 3  # 20 requests, never more than 3 in flight

    def short(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"scores": [1.0]})

    bad = client("http://scorer.test/score", batch_size=2, transport=httpx.MockTransport(short))
    with pytest.raises(RemoteRewardError, match=r"'scores' has 1 entries for 2 samples"):
        asyncio.run(bad.score(batch_of([1, 2])))
