"""The asynchronous turn loop (mmrlhf.agents.async_loop) against the lockstep one (mmrlhf.agents.lockstep).

- Over vLLM, per family, with a tool of random latency: the same trajectories (ids, masks, engine log-probs,
  images) as lockstep, for the same seeds; a different seed (the control) gives other trajectories.
- ``agent.loop: auto`` picks the asynchronous loop over vLLM's stream and lockstep over an engine without a
  continuous batch.
- Over a scripted engine (``agent.loop: async`` asked for): a slow call holds its own trajectory only (lockstep, the control, holds every one); the
  session pool's bound, with reusable environments reset and reused; a tool's ``max_concurrency`` over every
  trajectory's calls at once; turns ready within the gathering window sent in one engine call.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch
from PIL import Image
from test_agent_loop import Sessions, ScriptedEngine, _batch, _call_ids, _context, _ids, _loop, tiny  # noqa: F401
from test_agent_tool_failures import make_tool

from mmrlhf.agents.builtin_tools import ImageZoom
from mmrlhf.agents.loop_types import AgentLimits
from mmrlhf.agents.rollout import AgentLoop
from mmrlhf.agents.runner import ToolRunner
from mmrlhf.agents.tools import Tool
from mmrlhf.agents.types import StepResult, ToolContext, ToolResult
from mmrlhf.experience.agent_rows import encoder_of
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.tiny_models import TOY_CALL_TOKEN, tiny_model_dir
from mmrlhf.testing.tolerances import FP32_TOLERANCE

from agent_testing import colour, load_tools_model

RED = Image.new("RGB", (112, 112), (200, 40, 40))


class JitteryZoom(ImageZoom):
    """The zoom tool answering after a random delay (log-normal, a long tail): the calls come back in an order that
    differs from run to run."""

    def __call__(self, arguments, context):
        time.sleep(min(0.2, random.lognormvariate(-4.5, 1.0)))
        return super().__call__(arguments, context)


@pytest.mark.vllm
@pytest.mark.slow  # ~20 s per family: engine start, three loops of a dozen trajectories
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_asynchronous_loop_samples_the_lockstep_trajectories(family):
    pytest.importorskip("vllm")
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    model, processor, adapter, data = load_tools_model(family)
    del model
    tok = processor.tokenizer
    engine = VLLMEngine(str(tiny_model_dir(family, tools=True)), adapter, max_model_len=1024, dtype="float32",
                        limit_mm_per_prompt={"image": 6})
    tools = {"image_zoom": JitteryZoom()}
    runner = ToolRunner(tools, workers=4, timeout_s=10, max_image_pixels=10**7)
    limits = AgentLimits(max_turns=4, max_context_tokens=1024, max_new_tokens_per_turn=6, max_images=6)

    def loop(**changes):
        return AgentLoop(engine, tok, adapter, encoder_of(data), dataclasses.replace(limits, **changes),
                         [tok.eos_token_id], runner, tools=tools)

    images = [colour((200, 40, 40), (112, 84)), colour((40, 40, 200), (84, 112))]
    batch = data.process_multimodal_batch(["<image>What color?"] * 2, [[im] for im in images], ["red", "blue"],
                                          n_samples_per_prompt=6, record_ids=["r", "s"])
    contexts = []
    for k, (rid, image) in enumerate(zip("rs", images)):
        grid = batch.all_vision_inputs[k * 6]["image_grid_thw"][0]
        contexts.append(ToolContext(record={"id": rid}, images=[image],
                                    model_image_sizes=[(int(grid[2]) * adapter.patch_size,
                                                        int(grid[1]) * adapter.patch_size)]))
    # Four tokens: two words, the zoom call (one token), the end of turn: turns call the tool or answer, unevenly.
    keep = {tok.convert_tokens_to_ids(t) for t in ("red", "blue", TOY_CALL_TOKEN, "<|im_end|>")}
    forbidden = tuple(i for i in range(len(tok)) if i not in keep)
    sampling = SamplingSettings(n=6, temperature=1.0, max_new_tokens=6, seed=11, forbidden_token_ids=forbidden)
    try:
        assert loop().driver() == "async" and loop(loop="lockstep").driver() == "lockstep"  # auto over vLLM: async
        lockstep = loop(loop="lockstep").run(batch, 6, sampling, contexts)
        asynchronous = loop().run(batch, 6, sampling, contexts)
        pooled = loop(max_concurrent_trajectories=6).run(batch, 6, sampling, contexts)
        control = loop().run(batch, 6, dataclasses.replace(sampling, seed=12), contexts)
    finally:
        engine.close()
        runner.close()
    calls = [s.trajectory.num_tool_calls for s in lockstep.samples]
    assert len(lockstep.samples) == 12 and sum(calls) >= 6 and len(set(calls)) > 1, calls  # uneven trajectories
    for run in (asynchronous, pooled):
        for s, a in zip(lockstep.samples, run.samples, strict=True):
            assert (s.sample_index, s.response_ids, s.policy_mask) == (a.sample_index, a.response_ids, a.policy_mask)
            assert max(abs(x - y) for x, y in zip(s.engine_logprobs, a.engine_logprobs)) < FP32_TOLERANCE
            assert torch.equal(s.vision["pixel_values"], a.vision["pixel_values"])
            assert torch.equal(s.vision["image_grid_thw"], a.vision["image_grid_thw"])
            assert s.trajectory.ended == a.trajectory.ended
    assert [s.response_ids for s in control.samples] != [s.response_ids for s in lockstep.samples]


def _two_tools(delay: float):
    slow = make_tool("slow", lambda: time.sleep(delay) or "slow result", is_async=False)
    fast = make_tool("fast", lambda: "fast result", is_async=False)
    return {slow.name: slow, fast.name: fast}


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_a_slow_call_holds_its_own_trajectory_only(tiny, mode):
    """Trajectory 0 makes one call that takes 0.6 s; trajectory 1 makes three quick calls and answers. The
    asynchronous loop finishes trajectory 1 long before the slow call returns; lockstep (the control) makes it wait
    for the slow call at its turn. The trajectories are the same."""
    processor, adapter, data = tiny
    tok = processor.tokenizer
    answer = _ids(tok, "red", "<|im_end|>")
    slow, fast = (_call_ids(tok, '{"name": "%s", "arguments": {}}' % name) for name in ("slow", "fast"))
    scripts = {0: [slow, answer], 1: [fast, fast, fast, answer]}
    batch = _batch(data, 2, RED)
    loop = _loop(tiny, ScriptedEngine(scripts), tools=_two_tools(0.6),
                 limits=AgentLimits(max_turns=5, max_new_tokens_per_turn=64, loop=mode))
    assert _loop(tiny, ScriptedEngine(scripts)).driver() == "lockstep"  # auto: the scripted engine has no stream
    result = loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=64, seed=3), [_context(batch, RED)])
    first, second = (s.trajectory for s in result.samples)
    assert (first.num_tool_calls, second.num_tool_calls) == (1, 3)
    assert first.ended == second.ended == "answer"
    took = result.metrics["agent/trajectory_s/max"]
    quick = result.metrics["agent/trajectory_s/p50"]  # of two trajectories: the one that ended first
    assert took >= 0.6
    if mode == "async":
        assert quick < 0.3, quick
        assert result.metrics["agent/tool_wait_s/mean"] < 0.5  # (0.6 + ~0) / 2
    else:
        assert quick >= 0.6, quick


class Reusable:
    """An environment that serves trajectory after trajectory: ``reset`` starts a fresh episode. Counts the
    instances made, resets, closes and the sessions alive at once."""

    reusable = True
    made = resets = closes = live = most = 0

    def __init__(self) -> None:
        Reusable.made += 1
        Reusable.live += 1
        Reusable.most = max(Reusable.most, Reusable.live)
        self.taken = 0

    def reset(self, record):
        Reusable.resets += 1
        self.taken = 0
        return None

    def step(self, action_text):
        self.taken += 1
        return StepResult(ToolResult(text=f"step {self.taken}"), done=self.taken >= 2)

    def close(self):
        Reusable.closes += 1
        Reusable.live -= 1


@pytest.mark.parametrize("reuse", [True, False])
def test_the_pool_bounds_the_sessions_and_reuses_what_may_be_reused(tiny, reuse):
    """Three groups of two under a bound of two trajectories: never more than two sessions alive; a reusable
    environment serves all six trajectories from two instances (six resets, two closes at the end); any other is
    made per trajectory and closed when its trajectory ends. The trajectories are the same as lockstep's."""
    processor, adapter, data = tiny
    tok = processor.tokenizer
    cls = Reusable if reuse else Sessions
    turns = {k: [_ids(tok, ("blue", "red", "green")[k % 3], "<|im_end|>")] * 4 for k in range(6)}
    batch = data.process_multimodal_batch(["<image>What color?"] * 3, [[RED]] * 3, ["red"] * 3,
                                          n_samples_per_prompt=2, record_ids=["a", "b", "c"])
    runs = {}
    for mode in ("async", "lockstep"):
        for counter in ("made", "resets", "closes", "live", "most"):
            setattr(cls, counter, 0)
        loop = _loop(tiny, ScriptedEngine(turns), environment=cls,
                     limits=AgentLimits(max_turns=4, max_new_tokens_per_turn=8, max_concurrent_trajectories=2,
                                        loop=mode))
        runs[mode] = loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=8), [_context(batch, RED)] * 3)
        assert cls.most == 2 and cls.live == 0, (mode, cls.most, cls.live)
        if reuse and mode == "async":
            assert (Reusable.made, Reusable.resets, Reusable.closes) == (2, 6, 2)
        elif reuse:  # lockstep makes each wave's own
            assert (Reusable.made, Reusable.resets, Reusable.closes) == (6, 6, 6)
    for a, b in zip(runs["async"].samples, runs["lockstep"].samples, strict=True):
        assert (a.sample_index, a.response_ids, a.policy_mask) == (b.sample_index, b.response_ids, b.policy_mask)
        assert a.trajectory.ended == b.trajectory.ended == "done"


def test_a_tools_max_concurrency_holds_across_trajectories(tiny):
    """Six trajectories each call a tool bounded to one call at a time; their calls are separate batches of the
    runner in the asynchronous loop, and still never overlap."""
    processor, adapter, data = tiny
    tok = processor.tokenizer
    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    def narrow():
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.03)
        with lock:
            state["now"] -= 1
        return "ok"

    bounded = make_tool("narrow", narrow, is_async=False)
    bounded.max_concurrency = 1
    call = _call_ids(tok, '{"name": "narrow", "arguments": {}}')
    answer = _ids(tok, "red", "<|im_end|>")
    batch = _batch(data, 6, RED)
    loop = _loop(tiny, ScriptedEngine({k: [call, answer] for k in range(6)}), tools={bounded.name: bounded},
                 limits=AgentLimits(max_turns=3, max_new_tokens_per_turn=64, loop="async"))
    result = loop.run(batch, 6, SamplingSettings(n=6, max_new_tokens=64), [_context(batch, RED)])
    assert [s.trajectory.num_tool_calls for s in result.samples] == [1] * 6
    assert state["most"] == 1


class Sleeps(Tool):
    """Answers after ``s`` seconds (its argument)."""

    name, description = "sleeps", "waits"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}}

    def __call__(self, arguments, context):
        time.sleep(float(arguments["s"]))
        return "awake"


class CallsEngine(ScriptedEngine):
    """The scripted engine, recording which trajectories each ``generate`` call served."""

    def __init__(self, scripts):
        super().__init__(scripts)
        self.calls: list[list[int]] = []

    def generate(self, requests, settings):
        self.calls.append([int(r.request_id.rsplit("#", 1)[1]) for r in requests])
        return super().generate(requests, settings)


@pytest.mark.parametrize("window, delays, later_calls", [
    (2.0, (0.0, 0.1, 0.2, 0.3), [[0, 1, 2, 3]]),  # all back within the window: one call, once the last is back
    (0.0, (0.0, 0.1, 0.2, 0.3), None),  # the control: no window, each second turn on its own as it is ready
    (0.1, (0.0, 0.0, 0.0, 1.0), [[0, 1, 2], [3]]),  # the window bounds the wait: the slow call's turn goes alone
])
def test_turns_ready_within_the_gathering_window_go_to_the_engine_together(tiny, window, delays, later_calls):
    """Four trajectories call a tool answering after the given delays, then answer. The calls that answer within
    ``agent.gather_window_s`` of their start make their turns ready before the engine's next step, and those go to
    the engine in one call; the window is never waited out once every call answered (the first case ends long
    before its 2 s window), and never holds a turn for a call past it. The trajectories are the same whatever the
    window."""
    processor, adapter, data = tiny
    tok = processor.tokenizer
    answer = _ids(tok, "red", "<|im_end|>")
    scripts = {k: [_call_ids(tok, '{"name": "sleeps", "arguments": {"s": %g}}' % d), answer]
               for k, d in enumerate(delays)}
    batch = _batch(data, 4, RED)
    runs = {}
    for w in (window, 0.0):
        engine = CallsEngine(scripts)
        loop = _loop(tiny, engine, tools={"sleeps": Sleeps()},
                     limits=AgentLimits(max_turns=3, max_new_tokens_per_turn=64, loop="async", gather_window_s=w))
        t0 = time.perf_counter()
        runs[w] = (loop.run(batch, 4, SamplingSettings(n=4, max_new_tokens=64, seed=5), [_context(batch, RED)]),
                   engine.calls, time.perf_counter() - t0)
    result, calls, took = runs[window]
    assert [s.response_ids for s in result.samples] == [s.response_ids for s in runs[0.0][0].samples]
    assert calls[0] == [0]  # the group's shared first turn
    assert [s.trajectory.ended for s in result.samples] == ["answer"] * 4
    if later_calls is None:
        assert len(calls) > 2, calls  # one by one (4 calls on an idle machine)
    else:
        # which turns share a call, in any order within it (the tools' threads finish in any order under load)
        assert [sorted(c) for c in calls[1:]] == later_calls, calls
    if window == 2.0:
        assert took < 1.5, took
    if window == 0.1:  # the fast three did not wait for the slow call
        m = result.metrics
        assert m["agent/trajectory_s/p50"] < 0.6 <= 1.0 <= m["agent/trajectory_s/max"], m
    control = runs[0.0][0]
    for a, b in zip(result.samples, control.samples, strict=True):
        assert (a.sample_index, a.response_ids, a.policy_mask) == (b.sample_index, b.response_ids, b.policy_mask)
