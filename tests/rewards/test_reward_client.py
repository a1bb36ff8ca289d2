"""The remote reward client against scripted servers (httpx.MockTransport): what it accepts as a score, what it
sends as a reference, and when it retries."""

from __future__ import annotations

import asyncio
import email.utils
import json
import math

import httpx
import numpy as np
import pytest
import torch

import mmrlhf.rewards.remote as remote
from mmrlhf.config.reward import RemoteSourceConfig
from mmrlhf.rewards import (
    FunctionSource,
    RemoteRewardClient,
    RemoteRewardError,
    RewardBatch,
    RewardComputationEngine,
    RewardError,
    RewardInputError,
)
from mmrlhf.rewards.sources import ClientSource

URL = "http://scorer.test/score"


def batch_of(n: int, references=None, labels=None) -> RewardBatch:
    return RewardBatch(
        responses=[str(i) for i in range(n)],
        prompts=[""] * n,
        labels=labels or ["a"] * n,
        references=references if references is not None else [None] * n,
    )


def scripted(*answers, seen=None):
    """A transport answering each request with the next (status, raw body, headers); the last one repeats."""
    queue = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        status, body, headers = queue.pop(0) if len(queue) > 1 else queue[0]
        return httpx.Response(status, content=body.encode(), headers=headers or {})

    return httpx.MockTransport(handler)


def client(transport, **kw) -> RemoteRewardClient:
    defaults = dict(max_retries=2, backoff_s=0.01, backoff_max_s=0.02, seed=0, transport=transport)
    return RemoteRewardClient(URL, **{**defaults, **kw})


def test_non_finite_remote_scores_fail_their_sample_and_are_counted_by_the_engine():
    # Python's JSON reader accepts NaN and Infinity: they must fail their sample, never become a score.
    raw = '{"scores": [1.0, NaN, Infinity, -Infinity, 2], "parts": {"fmt": [1, 1, 1, 1, NaN]}}'
    res = asyncio.run(client(scripted((200, raw, None))).score(batch_of(5)))
    assert res.scores == [1.0, None, None, None, None]
    assert res.errors[0] is None
    assert all("non-finite" in res.errors[i] and f"sample {i}" in res.errors[i] for i in (1, 2, 3))
    assert "part 'fmt'" in res.errors[4] and res.parts["fmt"] == [1.0, None, None, None, None]

    def engine(policy):
        sources = {
            "judge": ClientSource(client(scripted((200, raw, None))), name="judge"),
            "one": FunctionSource(lambda responses, prompts, labels, references: [1.0] * len(responses), name="one"),
        }
        return RewardComputationEngine(sources, {"a": [("judge", 1.0), ("one", 1.0)]}, on_failure=policy)

    result = engine("mask").compute(batch_of(5))
    assert result.valid.tolist() == [True, False, False, False, False]
    assert torch.isfinite(result.rewards).all() and result.rewards[0].item() == 2.0
    assert result.metrics["reward/failed_samples"] == 4.0 and result.metrics["reward/judge/failures"] == 4.0
    with pytest.raises(RewardError, match=r"judge.*sample 1 .*non-finite"):
        engine("error").compute(batch_of(5))


def test_strings_booleans_and_lists_are_not_coerced_into_scores():
    raw = '{"scores": ["2.5", true, 3, 1.5, null, [1]]}'
    res = asyncio.run(client(scripted((200, raw, None))).score(batch_of(6)))
    assert res.scores == [None, None, 3.0, 1.5, None, None]
    assert "answered a str" in res.errors[0] and "answered a bool" in res.errors[1] and "list" in res.errors[5]
    assert res.errors[2] is None and res.errors[3] is None and res.errors[4] is None  # null: does not apply


def test_a_server_reported_error_fails_its_sample_even_with_a_score():
    raw = '{"scores": [1.0, 2.0], "errors": [null, "model overflow"]}'
    res = asyncio.run(client(scripted((200, raw, None))).score(batch_of(2)))
    assert res.scores == [1.0, None] and "model overflow" in res.errors[1] and "sample 1" in res.errors[1]


@pytest.mark.parametrize(
    "raw, words",
    [
        ('{"scores": [1.0]}', "'scores' has 1 entries for 2 samples"),
        ('{"scores": [1, 2], "parts": {"f": [1]}}', "'parts.f' has 1 entries"),
        ('{"scores": [1, 2], "bogus": 1}', "unknown field"),
        ("[1, 2]", "JSON object"),
        ("{not json", "not JSON"),
    ],
)
def test_a_misshapen_answer_fails_the_whole_request(raw, words):
    with pytest.raises(RemoteRewardError, match="malformed answer") as info:
        asyncio.run(client(scripted((200, raw, None))).score(batch_of(2)))
    assert words in str(info.value)


def test_references_are_sent_as_the_json_values_local_functions_get():
    seen: list[dict] = []
    refs = [3, 2.5, "x", None, [1, 2], {"a": 1}, True, np.int64(4), torch.tensor(0.5)]
    ok = json.dumps({"scores": [0.0] * len(refs)})
    asyncio.run(client(scripted((200, ok, None), seen=seen)).score(batch_of(len(refs), references=refs)))
    assert seen[0]["references"] == [3, 2.5, "x", None, [1, 2], {"a": 1}, True, 4, 0.5]
    assert [type(v) for v in seen[0]["references"][:2]] == [int, float]  # not turned into text
    with pytest.raises(RewardInputError, match=r"sample 1 \(label 'a'\): references: nan cannot be sent"):
        asyncio.run(client(scripted((200, ok, None))).score(batch_of(2, references=["1", math.nan])))
    with pytest.raises(RewardInputError, match=r"sample 0 \(label 'a'\): references: a object"):
        asyncio.run(client(scripted((200, ok, None))).score(batch_of(1, references=[object()])))


@pytest.mark.parametrize("status", [500, 400, 422])
def test_deterministic_failures_are_not_retried(status):
    c = client(scripted((status, '{"detail": "scorer returned 1 scores for 2 samples"}', None)), max_retries=5)
    with pytest.raises(RemoteRewardError, match=rf"HTTP {status}.*not retried.*\[408, 429, 502, 503, 504\]"):
        asyncio.run(c.score(batch_of(2)))
    assert c.requests_sent == 1


@pytest.mark.parametrize("status", [408, 429, 502, 503, 504])
def test_transient_statuses_are_retried(status):
    ok = '{"scores": [0, 1]}'
    c = client(scripted((status, '{"detail": "busy"}', None), (200, ok, None)))
    assert asyncio.run(c.score(batch_of(2))).scores == [0.0, 1.0]
    assert c.requests_sent == 2


@pytest.fixture
def fake_clock(monkeypatch):
    """Replaces the client's sleep with a clock that only advances when it 'sleeps'; returns the recorded waits."""
    now = {"t": 1000.0}
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        now["t"] += seconds

    monkeypatch.setattr(remote, "_sleep", sleep)
    monkeypatch.setattr(remote, "_clock", lambda: now["t"])
    return waits


def test_retry_after_is_honoured(fake_clock):
    ok = '{"scores": [0]}'
    c = client(scripted((503, "{}", {"Retry-After": "3"}), (429, "{}", {"Retry-After": "0"}), (200, ok, None)))
    assert asyncio.run(c.score(batch_of(1))).scores == [0.0]
    assert fake_clock[0] == 3.0  # what the server asked for (the backoff would have been ~0.01 s)
    assert 0 < fake_clock[1] <= 0.02  # "0": the client's own backoff still applies


def test_retry_after_asking_past_the_window_fails_at_once_saying_so(fake_clock):
    c = client(scripted((503, "{}", {"Retry-After": "120"})), retry_window_s=30)
    with pytest.raises(RemoteRewardError, match=r"retry window of 30 s is spent \(next retry was due in 120"):
        asyncio.run(c.score(batch_of(1)))
    assert fake_clock == [] and c.requests_sent == 1


def test_retry_after_header_forms():
    assert remote.retry_after_seconds("7") == 7.0
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert remote.retry_after_seconds(date, now=1_000_000.0) == pytest.approx(30.0)
    assert remote.retry_after_seconds("soon") is None and remote.retry_after_seconds(None) is None


def test_the_requests_of_one_batch_share_one_retry_window(fake_clock):
    """Every request fails twice before it succeeds. Alone, a request fits in the window; ten requests of one batch
    (sent one at a time) need about ten times its retry time, which the shared window does not grant."""
    tries: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key = body["responses"][0]
        tries[key] = tries.get(key, 0) + 1
        if tries[key] <= 2:
            return httpx.Response(503, json={"detail": "busy"})
        return httpx.Response(200, json={"scores": [0.0] * len(body["responses"])})

    settings = dict(batch_size=1, max_concurrency=1, max_retries=5, backoff_s=0.2, backoff_max_s=0.2,
                    retry_window_s=1.0)
    lone = client(httpx.MockTransport(handler), **settings)
    assert asyncio.run(lone.score(batch_of(1))).scores == [0.0]  # 2 retries, 0.2 to 0.4 s: within 1 s
    tries.clear()
    fake_clock.clear()
    many = client(httpx.MockTransport(handler), **settings)
    with pytest.raises(RemoteRewardError, match="retry window of 1 s is spent"):
        asyncio.run(many.score(batch_of(10)))  # 20 retries of >= 0.1 s each: over 1 s
    assert 0.8 < sum(fake_clock) <= 1.0 + 1e-9  # the batch waited out its window, and no more


def test_default_retries_outlast_a_server_restart():
    """serve-reward restarts in 3 to 8 s on the project machines: with the default settings a request must keep
    retrying well past that, even with the shortest jitter, and the shared window must allow it."""
    cfg = RemoteSourceConfig(type="remote", url=URL)
    shortest = sum(min(cfg.backoff_max_s, cfg.backoff_s * 2**k) / 2 for k in range(cfg.max_retries))
    assert shortest >= 2 * 8.0
    assert cfg.retry_window_s >= shortest
    c = RemoteRewardClient(URL)  # the client's own defaults are the config's
    assert (c.max_retries, c.backoff_s, c.backoff_max_s, c.retry_window_s) == (
        cfg.max_retries, cfg.backoff_s, cfg.backoff_max_s, cfg.retry_window_s
    )


def test_client_and_error_are_exported_from_the_package():
    import mmrlhf.rewards as rewards

    assert rewards.RemoteRewardClient is remote.RemoteRewardClient
    assert rewards.RemoteRewardError is remote.RemoteRewardError
    assert {"RemoteRewardClient", "RemoteRewardError"} <= set(rewards.__all__)
