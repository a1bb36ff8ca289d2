"""Environments are reused only when they are clean, and closed on every exit path of a step (both turn loops).

Over a scripted engine, with environments written to fail on cue: a step that raises, a step that hangs past the
deadline (its thread abandoned), a reset that raises, a reset that hangs, a reset that says there is no episode,
an engine that fails mid-step. Each environment says which record it serves (``info["served"]``), so a trajectory
played on another record's episode shows.
"""

from __future__ import annotations

import threading
import time

import pytest
from PIL import Image
from test_agent_loop import ScriptedEngine, _ids, _loop, tiny  # noqa: F401

from mmrlhf.agents.loop_types import AgentLimits
from mmrlhf.agents.types import StepResult, ToolContext, ToolResult
from mmrlhf.rollout.types import SamplingSettings

RED = Image.new("RGB", (112, 112), (200, 40, 40))
HANG_S = 5.0  # how long a hung call waits unless its environment is closed first
TIMEOUT_S = 0.3


class Served:
    """A reusable environment that reports the record of its last reset (``info["served"]``) and fails on cue: its
    step raises on the action ``red`` and hangs on ``green`` (until closed); its reset raises for the records in
    ``RAISE_AT`` and hangs for those in ``HANG_AT``; for those in ``NO_EPISODE`` it says ``done``. Each instance
    keeps the records it was reset for, how many it had when a call of it failed, and its closes."""

    reusable = True
    RAISE_AT: tuple[str, ...] = ()
    HANG_AT: tuple[str, ...] = ()
    NO_EPISODE: tuple[str, ...] = ()
    made: list["Served"] = []

    def __init__(self) -> None:
        Served.made.append(self)
        self.resets: list[str] = []
        self.failed_after: int | None = None  # resets it had had when a call failed
        self.closes = 0
        self.closed = threading.Event()
        self.busy = False
        self.closed_while_busy = False
        self.record: str | None = None
        self.taken = 0

    def _fail(self) -> None:
        if self.failed_after is None:
            self.failed_after = len(self.resets)

    def _hang(self) -> None:
        self.busy = True
        self.closed.wait(HANG_S)
        self.busy = False

    def reset(self, record):
        rid = record["id"]
        self.resets.append(rid)
        self.record, self.taken = None, 0
        if rid in self.RAISE_AT:
            self._fail()
            raise ConnectionError("the sandbox went away")
        if rid in self.HANG_AT:
            self._fail()
            self._hang()
        if rid in self.NO_EPISODE:
            return StepResult(ToolResult(text="nothing to play for this record"), done=True)
        self.record = rid
        return None

    def step(self, action_text):
        self.taken += 1
        if "red" in action_text:
            self._fail()
            raise RuntimeError("the game crashed")
        if "green" in action_text:
            self._fail()
            self._hang()
            self.taken = 99  # what a late call does to the episode once it returns
        return StepResult(ToolResult(text=f"step {self.taken}"), done=self.taken >= 2, info={"served": self.record})

    def close(self):
        self.closes += 1
        self.closed_while_busy |= self.busy
        self.closed.set()


def _contexts(batch, records: str, n: int) -> list[ToolContext]:
    out = []
    for g, rid in enumerate(records):
        grid = batch.all_vision_inputs[g * n]["image_grid_thw"]
        out.append(ToolContext(record={"id": rid}, images=[RED],
                               model_image_sizes=[(int(x[2]) * 14, int(x[1]) * 14) for x in grid]))
    return out


def _run(tiny, env, words: list[str], records: str, mode: str, *, bound: int = 2, engine=None):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    n = 2
    batch = data.process_multimodal_batch(["<image>What color?"] * len(records), [[RED]] * len(records),
                                          ["red"] * len(records), n_samples_per_prompt=n, record_ids=list(records))
    scripts = {k: [_ids(tok, w, "<|im_end|>")] * 4 for k, w in enumerate(words)}
    loop = _loop(tiny, engine(scripts) if engine else ScriptedEngine(scripts), environment=env, timeout=TIMEOUT_S,
                 limits=AgentLimits(max_turns=4, max_new_tokens_per_turn=8, max_concurrent_trajectories=bound,
                                    loop=mode))
    return loop.run(batch, n, SamplingSettings(n=n, max_new_tokens=8), _contexts(batch, records, n))


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_a_broken_environment_is_closed_and_never_serves_the_next_trajectory(tiny, mode):
    """Five records, one group (two trajectories) at a time: ``a`` (one step raises), ``b`` (reset raises), ``c``
    (one step hangs past the deadline), ``d`` (clean: in the asynchronous pool it runs on environments ``c`` and
    earlier records used), ``e`` (reset hangs). No environment is reset again after a call of it failed; each is
    closed once, the hung ones at once (beside the call still running in its abandoned thread, never waited for);
    a failed reset ends its trajectory before its first turn (``reset_failed``, counted, left out); every kept
    trajectory's environment served that trajectory's own record."""

    class Env(Served):
        RAISE_AT, HANG_AT = ("b",), ("e",)

    Served.made = []
    t0 = time.perf_counter()
    result = _run(tiny, Env, ["blue", "red", "blue", "blue", "green", "blue", "blue", "blue", "blue", "blue"],
                  "abcde", mode)
    took = time.perf_counter() - t0
    assert took < HANG_S / 2, took  # the hung calls were not waited for
    made = Served.made
    assert all(e.closes == 1 for e in made), [e.closes for e in made]
    failed = [e for e in made if e.failed_after is not None]
    assert all(len(e.resets) == e.failed_after for e in failed), [(e.resets, e.failed_after) for e in failed]
    assert len(failed) == 6  # a's raising step, b's two resets, c's hung step, e's two resets
    hung = [e for e in failed if e.resets[-1] in ("c", "e")]
    assert len(hung) == 3 and all(e.closed_while_busy for e in hung)
    if mode == "async":  # the pool still reuses what is clean: one environment served c, d, then e's reset
        assert len(made) == 6 and ["c", "d", "e"] in [e.resets for e in made], [e.resets for e in made]
    else:  # lockstep: every wave its own
        assert len(made) == 10 and all(len(e.resets) == 1 for e in made)
    kept = {s.sample_index: s.trajectory for s in result.samples}
    assert sorted(kept) == [0, 1, 4, 5, 6, 7]
    for k, t in kept.items():
        assert t.ended == "done"
        if "served" in t.info:
            assert t.info["served"] == "abcde"[k // 2], (k, t.info)
    assert [k for k, t in kept.items() if "served" in t.info] == [0, 5, 6, 7]
    assert kept[1].errors == ["tool_raised"] and kept[4].errors == ["timeout"]
    m = result.metrics
    assert m["agent/ended/reset_failed/count"] == 4.0 and m["agent/ended/before_first_turn/count"] == 4.0
    assert m["agent/errors/tool_raised/count"] == 3.0 and m["agent/errors/timeout/count"] == 3.0


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_a_reset_that_says_done_ends_its_trajectory_and_keeps_the_environment(tiny, mode):
    """A reset that answers ``done`` (no episode for record ``b``) ends its trajectories before their first turn,
    left out and counted (not as failures); the environment is clean, so the asynchronous pool reuses it."""

    class Env(Served):
        NO_EPISODE = ("b",)

    Served.made = []
    result = _run(tiny, Env, ["blue"] * 6, "abc", mode)
    assert [s.sample_index for s in result.samples] == [0, 1, 4, 5]
    assert all(s.trajectory.ended == "done" and s.trajectory.info["served"] == "abc"[s.group]
               for s in result.samples)
    m = result.metrics
    assert m["agent/ended/before_first_turn/count"] == 2.0 and m["agent/ended/reset_failed/count"] == 0.0
    assert m["agent/errors/tool_raised/count"] == 0.0
    assert all(e.closes == 1 and e.failed_after is None for e in Served.made)
    if mode == "async":
        assert sorted(e.resets for e in Served.made) == [["a", "b", "c"]] * 2
    else:
        assert len(Served.made) == 6


class FailingEngine(ScriptedEngine):
    """Raises at the second turn of trajectory 2 (an engine error mid-step)."""

    def generate(self, requests, settings):
        for req in requests:
            k = int(req.request_id.rsplit("#", 1)[1])
            if k == 2 and self.turn[k] >= 1:
                raise RuntimeError("the engine went away")
        return super().generate(requests, settings)


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_a_step_that_raises_closes_every_live_and_pooled_environment(tiny, mode, caplog):
    """Two groups at once; group ``a`` answers and ends (its environments go to the asynchronous pool), then the
    engine fails in group ``b``'s second turn. The error reaches the caller, and every environment, live or pooled,
    was closed once; the one whose close raises is logged as such, not swallowed."""

    class Env(Served):
        def step(self, action_text):
            self.taken += 1
            return StepResult(ToolResult(text="ok"), done="blue" in action_text, info={"served": self.record})

        def close(self):
            super().close()
            if self is Served.made[3]:
                raise OSError("the session was already gone")

    Served.made = []
    with pytest.raises(RuntimeError, match="the engine went away"):
        _run(tiny, Env, ["blue", "blue", "yellow", "yellow"], "ab", mode, bound=4, engine=FailingEngine)
    assert len(Served.made) == 4 and [e.closes for e in Served.made] == [1, 1, 1, 1]
    assert "1 closes failed" in caplog.text
