"""Where reward functions run: synchronous ones off the event loop (a bounded pool, or the main thread for those
that need it), so remote requests proceed while they compute."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mmrlhf.config import build_config
from mmrlhf.rewards import FunctionSource, RemoteRewardClient, RewardBatch, RewardComputationEngine, RewardError
from mmrlhf.rewards.math_accuracy import math_accuracy
from mmrlhf.rewards.runners import MAIN_THREAD_ATTR, main_thread
from mmrlhf.rewards.sources import ClientSource

WAIT_S = 20.0  # only reached when the behaviour under test is broken


def batch_of(n: int) -> RewardBatch:
    return RewardBatch(responses=["1"] * n, prompts=[""] * n, labels=["a"] * n, references=[None] * n)


def handshake_engine(fn) -> tuple[RewardComputationEngine, dict]:
    """An engine with ``fn`` (given the two events) and a remote source; each waits for the other to be running."""
    started, request_seen = threading.Event(), threading.Event()
    where: dict = {}

    def rule(responses, prompts, labels, references):
        where["thread"] = threading.current_thread()
        started.set()
        saw = request_seen.wait(WAIT_S)  # on the loop's thread this would block the request from ever being sent
        return [1.0 if saw else 0.0] * len(responses)

    async def handler(request: httpx.Request) -> httpx.Response:
        request_seen.set()
        deadline = time.monotonic() + WAIT_S
        while not started.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return httpx.Response(200, json={"scores": [2.0]})

    client = RemoteRewardClient("http://judge.test/score", transport=httpx.MockTransport(handler), max_retries=0)
    sources = {"rule": FunctionSource(fn(rule), name="rule"), "judge": ClientSource(client, name="judge")}
    return RewardComputationEngine(sources, {"a": [("rule", 1.0), ("judge", 1.0)]}), where


@pytest.mark.parametrize("marked", [False, True], ids=["pool", "main-thread"])
def test_a_sync_rule_computes_while_the_remote_request_is_in_flight(marked):
    engine, where = handshake_engine(main_thread if marked else (lambda f: f))
    result = engine.compute(batch_of(1))
    assert result.sources["rule"].tolist() == [1.0], "the rule finished without seeing the remote request"
    assert result.rewards.tolist() == [3.0]
    assert (where["thread"] is threading.main_thread()) == marked
    if not marked:
        assert where["thread"].name.startswith("reward-fn")


def test_the_pool_bounds_how_many_sync_functions_run_at_once():
    lock, state = threading.Lock(), {"active": 0, "most": 0}

    def probe(responses, prompts, labels, references):
        with lock:
            state["active"] += 1
            state["most"] = max(state["most"], state["active"])
        deadline = time.monotonic() + WAIT_S
        while state["active"] < 2 and time.monotonic() < deadline:  # wait for company (there are 2 threads)
            time.sleep(0.005)
        time.sleep(0.05)
        with lock:
            state["active"] -= 1
        return [1.0] * len(responses)

    pool = ThreadPoolExecutor(2)
    sources = {f"s{i}": FunctionSource(probe, name=f"s{i}", executor=pool) for i in range(5)}
    engine = RewardComputationEngine(sources, {"a": [(name, 1.0) for name in sources]}, executor=pool)
    assert engine.compute(batch_of(2)).rewards.tolist() == [5.0, 5.0]
    assert state["most"] == 2


def test_function_workers_sizes_one_pool_shared_by_the_function_sources():
    cfg = build_config(
        {"reward": {"label_map": {"f": "format", "g": "exact_match"}, "recipe": {"a": [["f", 1], ["g", 1]]},
                    "function_workers": 3}}
    ).reward
    engine = RewardComputationEngine.from_config(cfg)
    assert isinstance(engine.executor, ThreadPoolExecutor) and engine.executor._max_workers == 3
    assert all(source.executor is engine.executor for source in engine.sources.values())


def test_math_accuracy_runs_on_the_main_thread_where_its_signal_timeout_works():
    assert getattr(math_accuracy, MAIN_THREAD_ATTR, False)
    engine = RewardComputationEngine.from_config(
        build_config({"reward": {"label_map": {"m": "math_accuracy"}, "recipe": {"a": [["m", 1]]}}}).reward
    )
    batch = RewardBatch(responses=["<answer>\\frac{1}{2}</answer>", "<answer>3</answer>"], prompts=["", ""],
                        labels=["a", "a"], references=["0.5", 4])
    assert engine.compute(batch).rewards.tolist() == [1.0, 0.0]


def test_an_error_in_a_main_thread_function_reaches_the_caller():
    @main_thread
    def broken(responses, prompts, labels, references):
        return [1.0]  # wrong count

    engine = RewardComputationEngine({"b": FunctionSource(broken, name="b")}, {"a": [("b", 1.0)]})
    with pytest.raises(RewardError, match="returned 1 scores for 2 samples"):
        engine.compute(batch_of(2))
    # and the engine still works afterwards (the helper thread and its runner were torn down)
    ok = RewardComputationEngine({"b": FunctionSource(main_thread(lambda r, p, l, x: [1.0] * len(r)), name="b")},
                                 {"a": [("b", 1.0)]})
    assert ok.compute(batch_of(2)).rewards.tolist() == [1.0, 1.0]
