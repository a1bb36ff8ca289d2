"""Where a judge request's time goes, on every backend: ``latency_s`` is the judge's own time (send to answer),
``queue_s`` the wait before the send; and what the client does once per call instead of once per sample.

The endpoint runs against :class:`mmrlhf.testing.judge_server.FakeJudgeServer`, which answers after exactly
``DELAY_S``: at a concurrency of 1, N requests each take DELAY_S of the judge's time while the k-th waits k * DELAY_S
for its slot. (A clock started before the slot was taken read the k-th request as (k + 1) * DELAY_S.) The timing
bounds are the server's sleep by construction, with wide margins above it for a loaded machine, and medians where
one request stalled by the scheduler must not decide (one took 350 ms here at a load average of 11 on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from PIL import Image

from mmrlhf.config.reward import RewardConfig
from mmrlhf.rewards.engine import RewardComputationEngine
from mmrlhf.rewards.judge import rubric
from mmrlhf.rewards.judge.backends import EndpointJudge, JudgeReply, VllmJudge
from mmrlhf.rewards.judge.rubric import DEFAULT_RUBRIC, JudgeRequest, compile_rubric, render_request
from mmrlhf.rewards.types import RewardBatch
from mmrlhf.testing.judge_server import FakeJudgeServer

DELAY_S = 0.05
SLACK_S = 0.3  # above the server's sleep: scheduling on a shared 2-core machine
PROMPT = "<|im_start|>user\nWhat color is the square?<|im_end|>\n<|im_start|>assistant\n"
RED = Image.new("RGB", (56, 56), (255, 0, 0))


@pytest.fixture(scope="module")
def server():
    with FakeJudgeServer(delay_s=DELAY_S) as fake:
        yield fake


def _requests(n: int) -> list[JudgeRequest]:
    template = compile_rubric(DEFAULT_RUBRIC)
    return [render_request(template, question="q", reference=None, response=f"answer {i}", prompt="", images=[])
            for i in range(n)]


def test_endpoint_latency_is_the_request_and_queue_the_wait_for_a_slot(server):
    n = 10
    server.stats()
    judge = EndpointJudge(server.base_url, "fake", max_tokens=1, top_logprobs=5, max_concurrency=1)
    replies = asyncio.run(judge.run(_requests(n)))
    assert server.stats() == {"requests": n, "max_in_flight": 1}
    latency = [r.latency_s for r in replies]
    print(f"\nconcurrency 1: latency_s {[round(x, 3) for x in latency]}")
    assert min(latency) >= DELAY_S * 0.9
    # the back of the queue reads the judge's time too, not its wait (6 to 10 x 50 ms when the clock started early)
    assert statistics.median(latency) < 4 * DELAY_S and statistics.median(latency[n // 2:]) < 4 * DELAY_S
    queue = [r.queue_s for r in replies]
    print(f"queue_s {[round(x, 3) for x in queue]}")
    assert queue == sorted(queue) and queue[0] < 2 * DELAY_S  # first in, first sent
    assert queue[-1] >= (n - 1) * DELAY_S * 0.9  # behind n - 1 requests of 50 ms each

    # Control: the same requests with a slot each wait for nothing, and take the judge's time.
    wide = EndpointJudge(server.base_url, "fake", max_tokens=1, top_logprobs=5, max_concurrency=n)
    replies = asyncio.run(wide.run(_requests(n)))
    assert server.stats()["max_in_flight"] > 1
    assert min(r.latency_s for r in replies) >= DELAY_S * 0.9
    assert statistics.median(r.latency_s for r in replies) < DELAY_S + SLACK_S  # each connection is set up too
    assert statistics.median(r.queue_s for r in replies) < DELAY_S  # nobody waits for a slot


def test_engine_logs_latency_and_queue_per_step_and_neither_for_cache_hits(server):
    judge = {"type": "judge", "model": "fake", "url": server.base_url, "max_concurrency": 1, "max_tokens": 1}
    engine = RewardComputationEngine.from_config(RewardConfig(label_map={"judge": judge},
                                                              recipe={"vqa": [("judge", 1.0)]}))
    batch = RewardBatch(responses=[f"answer {i}" for i in range(4)], prompts=[PROMPT] * 4, labels=["vqa"] * 4,
                        references=[None] * 4)
    metrics = engine.compute(batch).metrics
    print(f"\nstep metrics: latency {metrics['reward/judge/latency_s/mean']:.3f}, "
          f"queue {metrics['reward/judge/queue_s/mean']:.3f}")
    assert DELAY_S * 0.9 <= metrics["reward/judge/latency_s/mean"] < DELAY_S + SLACK_S
    assert metrics["reward/judge/queue_s/mean"] >= (0 + 1 + 2 + 3) / 4 * DELAY_S * 0.9
    again = engine.compute(batch).metrics  # every sample from the cache: nothing was sent, nothing waited
    assert again["reward/judge/cache_hit/mean"] == 1.0
    assert "reward/judge/latency_s/mean" not in again and "reward/judge/queue_s/mean" not in again


def test_a_retrying_request_leaves_its_slot_during_its_backoff():
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        text = json.loads(request.content)["messages"][0]["content"][-1]["text"]
        sent.append("A" if "answer 0" in text else "B")
        if sent.count("A") == 1 and sent[-1] == "A":
            return httpx.Response(503, text="busy")
        return httpx.Response(200, json={"choices": [{"message": {"content": "yes"}}]})

    judge = EndpointJudge("http://judge/v1", "m", max_tokens=1, top_logprobs=0, max_concurrency=1, backoff_s=0.2,
                          transport=httpx.MockTransport(handler))
    replies = asyncio.run(judge.run(_requests(2)))
    assert [r.text for r in replies] == ["yes", "yes"] and judge.requests_sent == 3
    assert sent == ["A", "B", "A"]  # B went while A backed off
    assert replies[0].queue_s < 0.1  # its backoff (0.1 to 0.2 s) is not queueing


class _SlowLLM:
    """An engine whose generate takes DELAY_S (the vLLM backend's engine, without vLLM); the first generate starts
    its DELAY_S only once ``second_caller`` is set, so the second caller surely waits for all of it."""

    def __init__(self) -> None:
        self.generating, self.second_caller = threading.Event(), threading.Event()

    def chat(self, messages, params, use_tqdm=False, chat_template_kwargs=None):
        self.generating.set()
        self.second_caller.wait(timeout=10)
        time.sleep(DELAY_S)
        return [SimpleNamespace(outputs=[SimpleNamespace(text="yes", logprobs=None)]) for _ in messages]


def test_in_process_judge_queue_is_the_wait_for_the_engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    llm = _SlowLLM()
    judge = VllmJudge("unused", max_tokens=1, top_logprobs=0, llm=llm)

    async def two_callers():
        first = asyncio.ensure_future(judge.run(_requests(2)))
        while not llm.generating.is_set():
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(judge.run(_requests(1)))
        for _ in range(3):  # the second call runs up to the judge's lock: its arrival is clocked before the set below
            await asyncio.sleep(0)
        llm.second_caller.set()  # the first generate's DELAY_S starts now, after the second call arrived
        return await first, await second

    first, second = asyncio.run(two_callers())
    times = [(round(r.latency_s, 3), round(r.queue_s, 3)) for r in first + second]
    assert all(r.latency_s >= DELAY_S * 0.9 for r in first), times  # (its queue_s: a thread's start, unbounded)
    assert DELAY_S * 0.9 <= second[0].latency_s < DELAY_S + SLACK_S, times  # its own generate only
    assert DELAY_S * 0.9 <= second[0].queue_s < DELAY_S + SLACK_S, times  # behind the first one's generate


def test_ray_judge_queue_is_the_round_trip_less_the_generate():
    from mmrlhf.rewards.judge.ray_actor import RayActorJudge

    async def actor_run(requests):  # waits behind another generate, then "generates" for DELAY_S
        await asyncio.sleep(2 * DELAY_S)
        await asyncio.sleep(DELAY_S)
        return [JudgeReply(text="yes", top_logprobs=None, latency_s=DELAY_S, queue_s=0.0) for _ in requests]

    judge = RayActorJudge("judge", SimpleNamespace(actor_cpus=1))
    judge._handle = SimpleNamespace(run=SimpleNamespace(remote=actor_run))
    replies = asyncio.run(judge.run(_requests(2)))
    assert [r.latency_s for r in replies] == [DELAY_S, DELAY_S]
    assert all(2 * DELAY_S * 0.9 <= r.queue_s < 2 * DELAY_S + SLACK_S for r in replies)


def test_the_body_is_the_same_json_with_each_shared_part_serialised_once():
    parts = rubric.ImageParts()
    template = compile_rubric(DEFAULT_RUBRIC)
    asked = [render_request(template, question="q", reference=None, response=f"answer {i}", prompt="",
                            images=[RED], parts=parts) for i in range(4)]
    judge = EndpointJudge("http://judge/v1", "m", max_tokens=2, top_logprobs=5,
                          chat_template_kwargs={"enable_thinking": False})
    fragments: dict[int, bytes] = {}
    for request in asked:
        assert json.loads(judge.encode_body(request, fragments)) == judge.body(request)
    assert len(fragments) == 1 + len(asked)  # the shared image part once, one text part per sample
    assert json.loads(judge.encode_body(asked[0])) == judge.body(asked[0])  # alone, without a shared table
