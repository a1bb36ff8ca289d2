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
from mmrlhf.rewards.runners import MAIN_THREAD_ATTR, DaemonThreadPool, main_thread
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
    assert isinstance(engine.executor, DaemonThreadPool)
    assert len([t for t in threading.enumerate() if t.name.startswith("reward-fn") and t.daemon]) >= 3
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


# ---- a reward function that never returns ---------------------------------------------------------------------

def _hang(responses, prompts, labels, references):
    threading.Event().wait()  # never set
    return [1.0] * len(responses)


def _ok(responses, prompts, labels, references):
    return [1.0] * len(responses)


def _hang_engine(on_failure: str) -> RewardComputationEngine:
    pool = DaemonThreadPool(1, thread_name_prefix="reward-fn")
    sources = {"stuck": FunctionSource(_hang, name="stuck", executor=pool, timeout_s=0.5),
               "fine": FunctionSource(_ok, name="fine", executor=pool, timeout_s=5.0)}
    return RewardComputationEngine(sources, {"a": [("stuck", 1.0)], "b": [("fine", 1.0)]}, on_failure=on_failure,
                                   executor=pool)


def test_a_hung_function_times_out_and_is_masked_and_counted_or_raises():
    engine = _hang_engine("mask")
    batch = RewardBatch(responses=["1"] * 3, prompts=[""] * 3, labels=["a", "b", "a"], references=[None] * 3)
    t0 = time.monotonic()
    result = engine.compute(batch)
    assert time.monotonic() - t0 < WAIT_S / 2
    assert result.valid.tolist() == [False, True, False] and result.metrics["reward/failed_samples"] == 2
    # the pool's one worker is stuck for good: it was replaced, so the next call is served
    again = engine.compute(RewardBatch(responses=["1"], prompts=[""], labels=["b"], references=[None]))
    assert again.rewards.tolist() == [1.0]
    with pytest.raises(RewardError, match=r"'stuck' timed out after 0.5 s on 1 sample.*label_map.stuck.timeout_s"):
        _hang_engine("error").compute(RewardBatch(responses=["1"], prompts=[""], labels=["a"], references=[None]))


def test_the_config_key_bounds_function_sources():
    cfg = build_config({"reward": {"label_map": {"f": {"type": "function", "function": "format", "timeout_s": 7}},
                                   "recipe": {"a": [["f", 1]]}}}).reward
    assert RewardComputationEngine.from_config(cfg).sources["f"].timeout_s == 7


def _hang_announced(responses, prompts, labels, references):
    """``_hang``, saying first that it runs (the Ctrl-C test signals then, not after a guessed sleep)."""
    print("running", flush=True)
    return _hang(responses, prompts, labels, references)


HUNG_RUN = """
import faulthandler, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's: not an ignore inherited from the parent
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's diagnosis if the process does not end
sys.path.insert(0, {here!r})
from mmrlhf.config import build_config
from mmrlhf.rewards import RewardBatch, RewardComputationEngine
hang = {{"type": "function", "function": "test_reward_threads:_hang_announced", "timeout_s": 3600}}
cfg = build_config({{"reward": {{"label_map": {{"h": hang}}, "recipe": {{"a": [["h", 1]]}}}}}}).reward
engine = RewardComputationEngine.from_config(cfg)
engine.compute(RewardBatch(responses=["1"], prompts=[""], labels=["a"], references=[None]))
"""


def test_ctrl_c_ends_a_process_whose_reward_function_hangs():
    """KeyboardInterrupt reaches the main thread, and the hung worker thread does not keep the process alive
    (a ThreadPoolExecutor's workers are joined at exit: the process then never ended)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    code = HUNG_RUN.format(here=str(Path(__file__).parent))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).parents[2])
    try:
        before = []  # whatever start-up printed before the function ran
        while (line := proc.stdout.readline()) and line.strip() != "running":
            before.append(line)
        assert line, f"the process ended before its reward function ran:\n{''.join(before)}"
        # the function now runs in its thread: the signal comes when it is known to be there, no guessed sleep
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack, for the failure message
            time.sleep(2.0)
            proc.kill()
            stacks, _ = proc.communicate()
            pytest.fail(f"the process did not end within 15 s of Ctrl-C; its threads:\n{stacks}")
    assert proc.returncode != 0 and "KeyboardInterrupt" in out


def test_an_interrupted_computation_winds_its_loop_down_before_the_interrupt_propagates():
    """Ctrl-C while the loop thread still runs: the loop's task is cancelled and the thread has ended when
    KeyboardInterrupt leaves ``run_loop_serving_main_thread``. Left running, the thread could be inside a C++ call
    when the interpreter exits, which aborted the process ("terminate called without an active exception") in about
    1 of 20 Ctrl-Cs sent within 2 ms of a computation's start."""
    import signal

    from mmrlhf.rewards.runners import run_loop_serving_main_thread

    seen: list[str] = []

    async def interrupted() -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # Ctrl-C, while this task runs
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's (the suite may ignore it)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_loop_serving_main_thread(interrupted)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ["cancelled"]
    assert not [t for t in threading.enumerate() if t.name == "reward-loop"]
