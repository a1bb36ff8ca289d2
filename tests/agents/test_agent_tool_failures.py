"""Every way a tool can fail is the tool's failure, answered and counted once, and the runner goes on: exceptions of
every kind (``BaseException`` included: ``sys.exit``, ``KeyboardInterrupt``, ``GeneratorExit``, a subclass of its
own, a ``CancelledError`` an async tool raises itself), plain and async; a text over the limit; while a real
Ctrl-C of the user, which arrives in the main thread, still stops the wait (and the trainer's stop handler still
sees it)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import pytest
from agent_testing import Hang

from mmrlhf.agents.runner import ToolRunner
from mmrlhf.agents.tools import Tool
from mmrlhf.agents.types import ToolCall, ToolContext, ToolResult
from mmrlhf.trainer.interrupt import stop_on_interrupt

CTX = ToolContext(record={})
LONG = 200_000  # characters: the 200 kB message


class OwnBaseException(BaseException):
    """A tool's own BaseException subclass."""


def _reset():
    raise ConnectionResetError(104, "Connection reset by peer")


def _long_message():
    raise RuntimeError("x" * LONG)


def _zero():
    return 1 / 0


def _exit():
    sys.exit(3)


def _ctrl_c():
    raise KeyboardInterrupt


def _generator_exit():
    raise GeneratorExit


def _own():
    raise OwnBaseException("mine")


def _long_text():
    return "y " * (LONG // 2)


def _cancelled():
    raise asyncio.CancelledError


# name -> (what the tool does, the kind it must be counted as, what the answer must say)
FAILURES = {
    "reset": (_reset, "tool_raised", "ConnectionResetError: [Errno 104] Connection reset by peer"),
    "long_message": (_long_message, "tool_raised", "RuntimeError: xxx"),
    "zero": (_zero, "tool_raised", "ZeroDivisionError: division by zero"),
    "exit": (_exit, "tool_raised", "SystemExit: 3"),
    "ctrl_c": (_ctrl_c, "tool_raised", "raised KeyboardInterrupt."),
    "generator_exit": (_generator_exit, "tool_raised", "raised GeneratorExit."),
    "own": (_own, "tool_raised", "OwnBaseException: mine"),
    "long_text": (_long_text, "text_too_long", f"returned {LONG} characters of text, over the limit of 32768"),
}


def make_tool(name: str, action, *, is_async: bool) -> Tool:
    """A tool class named ``name`` (``a_`` + name when async) whose call does ``action``."""
    if is_async:
        async def call(self, arguments, context):
            await asyncio.sleep(0)
            return action()
    else:
        def call(self, arguments, context):
            return action()
    label = ("a_" if is_async else "") + name
    return type(label, (Tool,), {"name": label, "description": name, "__call__": call})()


def failing_tools() -> dict[str, Tool]:
    tools = {}
    for name, (action, _, _) in FAILURES.items():
        for is_async in (False, True):
            tool = make_tool(name, action, is_async=is_async)
            tools[tool.name] = tool
    cancelled = make_tool("cancelled", _cancelled, is_async=True)  # an async tool raising CancelledError itself
    tools[cancelled.name] = cancelled
    return tools


def expected_kind(tool_name: str) -> str:
    base = tool_name.removeprefix("a_")
    return "tool_raised" if base == "cancelled" else FAILURES[base][1]


class Fine(Tool):
    name = "fine"

    def __call__(self, arguments, context):
        return "fine"


def test_every_failure_is_answered_once_with_its_kind_and_the_runner_goes_on(caplog):
    tools = {**failing_tools(), "fine": Fine()}
    with ToolRunner(tools, workers=4, timeout_s=5.0, max_image_pixels=100) as runner:
        names = [n for n in tools if n != "fine"] * 2 + ["fine"]
        out = runner.run([(ToolCall(n, {}), CTX) for n in names])
        for name, (result, seconds) in zip(names, out):
            if name == "fine":
                assert result == ToolResult(text="fine")
                continue
            assert result.error == expected_kind(name), (name, result)
            assert result.text.startswith("Error: ") and len(result.text) <= 500, name  # short, whatever was raised
            base = name.removeprefix("a_")
            if base != "cancelled":
                assert FAILURES[base][2] in result.text, (name, result.text)
            assert 0.0 <= seconds < 5.0
        # Nothing was left behind: the next batch runs on the same threads and loop.
        again = runner.run([(ToolCall("fine", {}), CTX), (ToolCall("a_exit", {}), CTX)])
        assert [r.error for r, _ in again] == [None, "tool_raised"]
    logged = [r for r in caplog.records if r.name == "mmrlhf.agents.runner" and " raised " in r.getMessage()]
    raising = sum(expected_kind(n) == "tool_raised" for n in tools if n != "fine")
    assert len(logged) == 2 * raising + 1 and all(r.exc_info for r in logged)  # each traceback logged once


def test_a_task_an_async_tool_leaves_behind_cannot_stop_the_event_loop(caplog):
    """asyncio re-raises a task's KeyboardInterrupt out of the loop itself: a task a tool started and left running
    that raises one is logged, and the next async calls run at once on the same loop (not at their deadline)."""
    class Leaves(Tool):
        name = "leaves"

        async def __call__(self, arguments, context):
            async def later():
                await asyncio.sleep(0.05)
                raise KeyboardInterrupt

            asyncio.get_running_loop().create_task(later())
            return "left a task"

    with ToolRunner({"leaves": Leaves(), **failing_tools()}, workers=1, timeout_s=3.0,
                    max_image_pixels=100) as runner:
        (first, _), = runner.run([(ToolCall("leaves", {}), CTX)])
        time.sleep(0.3)  # the task raises meanwhile
        start = time.monotonic()
        out = runner.run([(ToolCall("a_zero", {}), CTX), (ToolCall("leaves", {}), CTX)])
        assert time.monotonic() - start < 1.0
    assert first.text == "left a task" and [r.error for r, _ in out] == ["tool_raised", None]
    assert any("the tool event loop goes on" in r.getMessage() for r in caplog.records)


def test_the_runners_own_deadline_cancellation_stays_a_timeout():
    class Slow(Tool):
        name = "slow"

        async def __call__(self, arguments, context):
            await asyncio.sleep(5)

    with ToolRunner({"slow": Slow()}, workers=1, timeout_s=0.2, max_image_pixels=100) as runner:
        (result, _), = runner.run([(ToolCall("slow", {}), CTX)])
    assert result.error == "timeout"


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_a_real_ctrl_c_in_the_main_thread_still_stops_the_wait():
    """The user's Ctrl-C (SIGINT with Python's default handler) reaches the main thread while it waits for the
    calls: KeyboardInterrupt propagates out of the wait at once, as always (a tool's own KeyboardInterrupt, above,
    never does: it is raised in a worker)."""
    assert threading.current_thread() is threading.main_thread()
    hang = Hang()
    runner = ToolRunner({"hang": hang, **failing_tools()}, workers=2, timeout_s=10.0, max_image_pixels=100)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            runner.run([(ToolCall("hang", {}), CTX), (ToolCall("ctrl_c", {}), CTX)])
        assert time.monotonic() - start < 3.0  # not at the hung call's deadline (10 s) or its end (5 s)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
        hang.release.set()
        runner.close()


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_the_trainers_stop_handler_sees_a_real_ctrl_c_and_not_a_tools_keyboard_interrupt():
    """Under :func:`stop_on_interrupt` (the training loop's handler): a tool raising KeyboardInterrupt does not ask
    the run to stop; a SIGINT sent to the process while the calls run does (the batch still finishes, so the step
    can end and save); a second one aborts the wait."""
    tools = failing_tools()
    hang = Hang()
    with ToolRunner({**tools, "hang": hang}, workers=2, timeout_s=1.0, max_image_pixels=100) as runner:
        with stop_on_interrupt() as flag:
            out = runner.run([(ToolCall("ctrl_c", {}), CTX), (ToolCall("a_ctrl_c", {}), CTX)])
            assert [r.error for r, _ in out] == ["tool_raised", "tool_raised"] and not flag.requested
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            out = runner.run([(ToolCall("hang", {}), CTX)])
            timer.join()
            assert flag.requested and out[0][0].error == "timeout"  # the first Ctrl-C: finish, then stop
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt):  # the second one aborts
                    runner.run([(ToolCall("hang", {}), CTX)])
            finally:
                timer.join()
        hang.release.set()
