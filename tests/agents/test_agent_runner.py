"""Running tool calls concurrently under per-call deadlines: concurrency, timeouts that block nothing, raising tools,
async tools, oversize images, environment steps."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from agent_testing import Hang
from PIL import Image

from mmrlhf.agents.example_env import GuessNumber
from mmrlhf.agents.runner import ToolRunner
from mmrlhf.agents.tools import Tool
from mmrlhf.agents.types import StepResult, ToolCall, ToolContext, ToolResult
from mmrlhf.config.agent import AgentConfig

CTX = ToolContext(record={})


class Sleep(Tool):
    name = "sleep"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}}

    def __call__(self, arguments, context):
        time.sleep(arguments.get("s", 0.3))
        return f"slept {arguments.get('s', 0.3)}"


class Boom(Tool):
    name = "boom"

    def __call__(self, arguments, context):
        raise ValueError("boom at the tool")


class AsyncSleep(Tool):
    name = "async_sleep"

    def __init__(self):
        self.cancelled = threading.Event()

    async def __call__(self, arguments, context):
        try:
            await asyncio.sleep(arguments.get("s", 0.3))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return ToolResult(text="async done")


class Big(Tool):
    name = "big"

    def __call__(self, arguments, context):
        return ["here", Image.new("RGB", (arguments.get("w", 200), 100))]


class Wrong(Tool):
    name = "wrong"

    def __call__(self, arguments, context):
        return 42


class Mutate(Tool):
    name = "mutate"

    def __call__(self, arguments, context):
        arguments["x"] = "changed"
        return "ok"


@pytest.fixture
def hang():
    tool = Hang()
    yield tool
    tool.release.set()  # free the abandoned thread


def runner(*tools, workers=8, timeout_s=2.0, max_image_pixels=100_000) -> ToolRunner:
    return ToolRunner({t.name: t for t in tools}, workers=workers, timeout_s=timeout_s,
                      max_image_pixels=max_image_pixels)


def test_sync_calls_run_concurrently():
    n = 8
    with runner(Sleep(), workers=n) as r:
        start = time.monotonic()
        out = r.run([(ToolCall("sleep", {"s": 0.3}), CTX)] * n)
        elapsed = time.monotonic() - start
    assert [res.text for res, _ in out] == ["slept 0.3"] * n
    assert all(0.25 < seconds < 1.0 for _, seconds in out)
    assert elapsed < n * 0.3 / 2, elapsed


def test_results_come_back_in_job_order():
    with runner(Sleep()) as r:
        out = r.run([(ToolCall("sleep", {"s": s}), CTX) for s in (0.3, 0.0, 0.15)])
    assert [res.text for res, _ in out] == ["slept 0.3", "slept 0.0", "slept 0.15"]


def test_a_hung_call_times_out_without_blocking_the_fast_one(hang):
    with runner(hang, Sleep(), timeout_s=0.2) as r:
        start = time.monotonic()
        (slow, slow_s), (fast, _) = r.run([(ToolCall("hang", {}), CTX), (ToolCall("sleep", {"s": 0.01}), CTX)])
        elapsed = time.monotonic() - start
    assert slow.error == "timeout" and "hang did not answer within 0.2 s" in slow.text
    assert 0.2 <= slow_s < 1.0
    assert fast.error is None and fast.text == "slept 0.01"
    assert elapsed < 1.0, elapsed


def test_a_hung_call_does_not_starve_a_one_thread_pool(hang):
    # the fast call waits behind the hung one; the hung thread is abandoned and replaced at its deadline
    with runner(hang, Sleep(), workers=1, timeout_s=0.2) as r:
        start = time.monotonic()
        out = r.run([(ToolCall("hang", {}), CTX), (ToolCall("sleep", {"s": 0.01}), CTX)])
        assert [res.error for res, _ in out] == ["timeout", None]
        out = r.run([(ToolCall("sleep", {"s": 0.01}), CTX)])  # the next batch has its thread too
        assert out[0][0].text == "slept 0.01"
    assert time.monotonic() - start < 1.5


def test_a_raising_tool_is_answered_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="mmrlhf.agents.runner"), runner(Boom(), Sleep()) as r:
        (result, _), (other, _) = r.run([(ToolCall("boom", {}), CTX), (ToolCall("sleep", {"s": 0}), CTX)])
    assert result == ToolResult(text="Error: boom raised ValueError: boom at the tool", error="tool_raised")
    assert other.error is None
    record = next(r for r in caplog.records if "boom raised ValueError" in r.getMessage())
    assert record.exc_info is not None and "boom at the tool" in caplog.text


def test_async_tools_run_concurrently_and_are_cancelled_at_their_deadline():
    tool = AsyncSleep()
    with runner(tool, timeout_s=0.5) as r:
        start = time.monotonic()
        out = r.run([(ToolCall("async_sleep", {"s": 0.3}), CTX)] * 6)
        assert time.monotonic() - start < 6 * 0.3 / 2
        assert [res.text for res, _ in out] == ["async done"] * 6
        (late, _), = r.run([(ToolCall("async_sleep", {"s": 5}), CTX)])
        assert late.error == "timeout"
        assert tool.cancelled.wait(1.0)  # the coroutine itself was cancelled, not just left behind


class BlockingAsync(Tool):
    """A badly written async tool: it blocks the event loop instead of awaiting."""

    name = "blocking_async"

    def __init__(self):
        self.release = threading.Event()

    async def __call__(self, arguments, context):
        self.release.wait(5.0)
        return "late"


def test_an_async_tool_blocking_the_loop_does_not_block_the_batch_or_later_ones():
    blocker, fine = BlockingAsync(), AsyncSleep()
    try:
        with runner(blocker, fine, timeout_s=0.3) as r:
            start = time.monotonic()
            out = r.run([(ToolCall("blocking_async", {}), CTX), (ToolCall("async_sleep", {"s": 0.01}), CTX)])
            assert [res.error for res, _ in out] == ["timeout", "timeout"]  # the second never got the loop
            assert time.monotonic() - start < 1.0
            (later, _), = r.run([(ToolCall("async_sleep", {"s": 0.01}), CTX)])  # a fresh loop
            assert later.error is None and later.text == "async done"
    finally:
        blocker.release.set()


def test_oversize_images_and_wrong_return_types_are_errors():
    with runner(Big(), Wrong(), max_image_pixels=100 * 100) as r:
        out = r.run([(ToolCall("big", {"w": 101}), CTX), (ToolCall("big", {"w": 100}), CTX),
                     (ToolCall("wrong", {}), CTX), (ToolCall("missing", {}), CTX)])
    (big, _), (fits, _), (wrong, _), (missing, missing_s) = out
    assert big.error == "image_too_large" and "101x100" in big.text and "10000" in big.text
    assert fits.error is None and fits.images[0].size == (100, 100) and fits.text == "here"
    assert wrong.error == "tool_raised" and "'wrong' returned a int" in wrong.text
    assert missing.error == "unknown_tool" and "Available tools: big, wrong" in missing.text and missing_s == 0.0


def test_arguments_are_passed_as_a_copy():
    call = ToolCall("mutate", {"x": "original"})
    with runner(Mutate()) as r:
        assert r.run([(call, CTX)])[0][0].text == "ok"
    assert call.arguments == {"x": "original"}


def test_from_config_and_closing():
    cfg = AgentConfig(tools=["calculator"], tool_workers=3, tool_timeout_s=1.5, max_image_pixels=1234)
    r = ToolRunner.from_config({}, cfg)
    assert (r.workers, r.timeout_s, r.max_image_pixels) == (3, 1.5, 1234)
    r.close()
    r.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        r.run([(ToolCall("x", {}), CTX)])
    with pytest.raises(ValueError, match="workers"):
        ToolRunner({}, workers=0, timeout_s=1, max_image_pixels=1)


class Broken:
    def reset(self, record):
        return ToolResult(text="hello", images=[Image.new("RGB", (10, 10))])

    def step(self, action_text):
        if action_text == "raise":
            raise RuntimeError("env broke")
        if action_text == "hang":
            time.sleep(1.0)
        if action_text == "wrong":
            return "not a step result"
        return StepResult(ToolResult(text="fine"))


class AsyncEnv:
    async def reset(self, record):
        return None

    async def step(self, action_text):
        await asyncio.sleep(0.01)
        return StepResult(ToolResult(text=f"async {action_text}"), done=True, info={"k": 1})


def test_environment_steps_under_the_same_rules():
    guess = GuessNumber(low=1, high=10)
    guess.reset({"target": 7})
    envs = [guess, Broken(), Broken(), Broken(), Broken(), AsyncEnv()]
    with runner(timeout_s=0.3) as r:
        out = r.run_environment_steps(envs, ["<guess>3</guess>", "ok", "raise", "hang", "wrong", "go"])
    results = [res for res, _ in out]
    assert results[0].observation.text.startswith("3 is too low") and not results[0].done
    assert results[1] == StepResult(ToolResult(text="fine"))
    assert results[2].done and results[2].observation.error == "tool_raised" and "env broke" in \
        results[2].observation.text
    assert results[3].done and results[3].observation.error == "timeout"
    assert results[4].done and results[4].observation.error == "tool_raised" and "not a StepResult" in \
        results[4].observation.text
    assert results[5] == StepResult(ToolResult(text="async go"), done=True, info={"k": 1})
    with pytest.raises(ValueError, match="2 environments but 1 actions"):
        runner().run_environment_steps([guess, guess], ["x"])


def test_environment_resets():
    with runner(max_image_pixels=50) as r:
        out = r.run_environment_resets([GuessNumber(intro=True), AsyncEnv(), Broken()], [{"id": 1}] * 3)
    (intro, _), (none, _), (big, _) = out
    assert not intro.done and "from 1 to 100" in intro.observation.text
    assert none is None
    assert big.done and big.observation.error == "image_too_large"


class Counting(Tool):
    """Sleeps ``s`` and records how many of its calls ran at once."""

    name = "counting"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}}

    def __init__(self, max_concurrency=None):
        self.max_concurrency = max_concurrency
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def __call__(self, arguments, context):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(arguments.get("s", 0.15))
        with self.lock:
            self.now -= 1
        return "counted"


class AsyncCounting(Counting):
    name = "async_counting"

    async def __call__(self, arguments, context):
        self.now += 1  # one event loop: no lock needed
        self.most = max(self.most, self.now)
        await asyncio.sleep(arguments.get("s", 0.15))
        self.now -= 1
        return "counted"


@pytest.mark.parametrize("cls", [Counting, AsyncCounting])
def test_a_tools_max_concurrency_bounds_its_calls_and_not_the_others(cls):
    """Six calls of a tool bounded to 2 run two at a time, each charged only its own 0.15 s; an unbounded tool's
    calls in the same batch are not held behind them. Control: unbounded, the six run together."""
    bounded = cls(max_concurrency=2)
    with runner(bounded, Sleep(), workers=8) as r:
        start = time.monotonic()
        out = r.run([(ToolCall(bounded.name, {"s": 0.15}), CTX)] * 6 + [(ToolCall("sleep", {"s": 0.01}), CTX)])
        elapsed = time.monotonic() - start
    assert bounded.most == 2 and [res.text for res, _ in out[:6]] == ["counted"] * 6
    assert all(seconds < 0.4 for _, seconds in out[:6])  # queued behind its bound: not charged for the wait
    assert elapsed >= 3 * 0.15 and out[6][0].text == "slept 0.01"
    free = cls()
    with runner(free, workers=8) as r:
        r.run([(ToolCall(free.name, {"s": 0.15}), CTX)] * 6)
    assert free.most == 6


def test_a_hung_call_leaves_its_tools_bound_at_its_deadline(hang):
    """A tool bounded to one call at a time whose first call hangs: the runner gives up on it at its deadline and
    the next call of the tool starts then (it does not wait for the abandoned thread)."""
    hang.max_concurrency = 1
    with runner(hang, workers=4, timeout_s=0.2) as r:
        start = time.monotonic()
        out = r.run([(ToolCall("hang", {}), CTX), (ToolCall("hang", {}), CTX)])
        elapsed = time.monotonic() - start
    assert [res.error for res, _ in out] == ["timeout", "timeout"]
    assert 0.4 <= elapsed < 1.5, elapsed  # one deadline after the other, never forever


def test_max_concurrency_from_the_config_entry():
    from mmrlhf.agents.tool_base import ToolSpecError
    from mmrlhf.agents.tools import build_tool
    from mmrlhf.config import ConfigError, build_config

    assert build_tool({"tool": "image_zoom", "max_concurrency": 3}).max_concurrency == 3
    assert build_tool("image_zoom").max_concurrency is None
    with pytest.raises(ConfigError, match="max_concurrency"):
        build_config({}, ["agent.tools=[{tool: image_zoom, max_concurrency: 0}]"])
    bad = Counting(max_concurrency=0)
    from mmrlhf.agents.tool_base import check_tool

    with pytest.raises(ToolSpecError, match="max_concurrency must be a positive int"):
        check_tool(bad, "counting")
