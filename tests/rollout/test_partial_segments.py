"""Partial rollouts, the segment bookkeeping (``mmrlhf.rollout.partial``) against a scripted engine: what each
segment asks for (length cap, minimum left, seed, continuation prompt), which completions continue, the per-token
versions, skips, and what is refused. The engines' own behaviour under it is tested with vLLM in
test_partial_vllm.py and through a rollout actor in tests/launch/test_partial_holder.py."""

from __future__ import annotations

import dataclasses

import pytest

from mmrlhf.rollout.partial import SegmentedEngine, generate_in_segments
from mmrlhf.rollout.types import (
    Completion,
    GenerationOutput,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    mix_seed,
)


class _Adapter:
    family = "scripted"

    @staticmethod
    def engine_prompt_ids(ids):
        return None if 999 in ids else list(ids)  # 999 stands for a video pad that must travel as text


class ScriptedEngine:
    """Answers every request with the next tokens of a fixed script per (prompt's first id, sample): token ids
    count up from 100 * (script + 1), log-prob -0.1 * token position; a script ends ("stop") at its length."""

    adapter = _Adapter()

    def __init__(self, lengths: dict[tuple[int, int], int], skip_prompt_len: int | None = None):
        self.lengths, self.calls, self.skip_prompt_len = lengths, [], skip_prompt_len

    def generate(self, requests, settings):
        self.calls.append((requests, settings))
        outputs, skipped = [], {}
        for i, req in enumerate(requests):
            if self.skip_prompt_len is not None and len(req.prompt_token_ids) >= self.skip_prompt_len:
                skipped[i] = "too long"
                continue
            completions = []
            for j in range(settings.n):
                # a continuation (its request id ends "#sample") continues that sample's script
                sample = int(req.request_id.split("#")[1]) if "#" in (req.request_id or "") else j
                key = (req.prompt_token_ids[0], sample)
                done = len(req.prompt_token_ids) - 2  # the scripted prompts hold 2 ids
                total = self.lengths[key]
                new = list(range(done, min(total, done + settings.max_new_tokens)))
                completions.append(Completion([100 * (key[1] + 1) + t for t in new], [-0.1 * t for t in new],
                                              "stop" if done + len(new) == total else "length"))
            outputs.append(GenerationOutput(i, list(req.prompt_token_ids), completions))
        return GenerationResult(outputs, skipped)


def _requests():
    return [GenerationRequest("a", prompt_token_ids=[1, 2], mm_token_type_ids=[0, 1], request_id="rec-a"),
            GenerationRequest("b", prompt_token_ids=[3, 4], request_id="rec-b")]


def test_unfinished_answers_continue_under_the_version_of_each_segment():
    # request 0: answers of 3 and 9 tokens; request 1: 4 (it stops exactly at the boundary) and 12 (cut at 10)
    engine = ScriptedEngine({(1, 0): 3, (1, 1): 9, (3, 0): 4, (3, 1): 12})
    versions = iter([5, 5, 6, 7])  # what the gate answers before segments 0, 1, 2, 3
    asked = []

    def boundary(segment):
        asked.append(segment)
        return next(versions)

    settings = SamplingSettings(n=2, max_new_tokens=10, min_new_tokens=6, seed=42)
    result = generate_in_segments(engine, _requests(), settings, segment_tokens=4, boundary=boundary)
    assert asked == [0, 1, 2] and result.segment_versions == [5, 5, 6]
    (a, b) = result.outputs
    ids = {(o.request_index, j): c for o in result.outputs for j, c in enumerate(o.completions)}
    assert [len(ids[k].token_ids) for k in sorted(ids)] == [3, 9, 4, 10]
    assert ids[(0, 1)].token_ids == [200 + t for t in range(9)]  # one answer, its pieces in order
    assert ids[(0, 1)].logprobs == pytest.approx([-0.1 * t for t in range(9)])
    assert ids[(0, 1)].token_versions == [5] * 4 + [5] * 4 + [6]
    assert ids[(1, 1)].token_versions == [5] * 8 + [6] * 2
    assert ids[(0, 0)].token_versions == [5] * 3 and ids[(0, 0)].finish_reason == "stop"
    assert ids[(1, 1)].finish_reason == "length"  # the cap of 10 ended it, not a segment
    # segment 0 is the caller's call with the segment's cap; the minimum is what is left of it
    first = engine.calls[0][1]
    assert (first.n, first.max_new_tokens, first.min_new_tokens, first.seed) == (2, 4, 4, 42)
    # continuations: one request per unfinished answer (a stop at the boundary ended (1, 0)), its own tokens
    # appended as text-typed ids, the record and sample named, a new seed per segment, the cap and minimum left
    reqs, s1 = engine.calls[1]
    assert [r.request_id for r in reqs] == ["rec-a#1", "rec-b#1"]
    assert reqs[0].prompt_token_ids == [1, 2, 200, 201, 202, 203] and reqs[0].mm_token_type_ids == [0, 1, 0, 0, 0, 0]
    assert reqs[1].mm_token_type_ids is None and reqs[0].prompt == "a"
    assert (s1.n, s1.max_new_tokens, s1.min_new_tokens, s1.seed) == (1, 4, 2, mix_seed(42, 1))
    reqs, s2 = engine.calls[2]
    assert (s2.max_new_tokens, s2.min_new_tokens, s2.seed) == (2, 0, mix_seed(42, 2))  # 10 - 8 tokens left
    assert len(engine.calls) == 3 and len(reqs) == 2


def test_a_request_with_its_own_seed_continues_from_its_samples_own_streams():
    """A request carrying its own seed (an agent's turn): sample j's continuation in segment s draws from
    mix_seed(seed + j, s), whatever its position among the continued answers; a request without one keeps none."""
    engine = ScriptedEngine({(1, 0): 6, (1, 1): 6, (3, 0): 6, (3, 1): 2})
    requests = [dataclasses.replace(_requests()[0], seed=700), _requests()[1]]
    generate_in_segments(engine, requests, SamplingSettings(n=2, max_new_tokens=8, seed=42), segment_tokens=4,
                         boundary=lambda s: 0)
    reqs, _ = engine.calls[1]
    assert [r.request_id for r in reqs] == ["rec-a#0", "rec-a#1", "rec-b#0"]
    assert [r.seed for r in reqs] == [mix_seed(700, 1), mix_seed(701, 1), None]
    assert engine.calls[0][0][0].seed == 700  # segment 0 is the caller's request as it is


def test_one_segment_when_every_answer_fits_and_no_seed_stays_none():
    engine = ScriptedEngine({(1, 0): 2, (3, 0): 3})
    result = generate_in_segments(engine, _requests(), SamplingSettings(max_new_tokens=8), segment_tokens=4,
                                  boundary=lambda s: 0)
    assert result.segment_versions == [0] and len(engine.calls) == 1 and engine.calls[0][1].seed is None
    assert [c.token_versions for o in result.outputs for c in o.completions] == [[0, 0], [0, 0, 0]]


def test_a_skipped_continuation_ends_its_answer_and_a_skipped_prompt_stays_skipped():
    engine = ScriptedEngine({(1, 0): 9, (3, 0): 2}, skip_prompt_len=6)  # continuations of 4 tokens are too long
    result = generate_in_segments(engine, _requests(), SamplingSettings(max_new_tokens=9), segment_tokens=4,
                                  boundary=lambda s: s)
    (a, b) = result.outputs
    assert a.completions[0].token_ids == [100, 101, 102, 103] and a.completions[0].finish_reason == "length"
    assert b.completions[0].token_versions == [0, 0]
    skipping = ScriptedEngine({(1, 0): 2, (3, 0): 2}, skip_prompt_len=2)  # every prompt too long
    result = generate_in_segments(skipping, _requests(), SamplingSettings(max_new_tokens=4), segment_tokens=4,
                                  boundary=lambda s: 0)
    assert result.outputs == [] and set(result.skipped) == {0, 1}


def test_refused_inputs_are_named():
    engine = ScriptedEngine({})
    with pytest.raises(ValueError, match="stop strings"):
        generate_in_segments(engine, _requests(), SamplingSettings(stop=("###",)), segment_tokens=4,
                             boundary=lambda s: 0)
    text_only = [dataclasses.replace(_requests()[0], prompt_token_ids=[1, 999, 2], request_id="vid-7")]
    with pytest.raises(ValueError, match=r"record 'vid-7' \(request 0\).*sent to the engine as text"):
        generate_in_segments(engine, text_only, SamplingSettings(), segment_tokens=4, boundary=lambda s: 0)
    with pytest.raises(ValueError, match="partial_segment_tokens must be >= 1"):
        generate_in_segments(engine, _requests(), SamplingSettings(), segment_tokens=0, boundary=lambda s: 0)
    engine.routing_replay = "record"
    with pytest.raises(ValueError, match="routing_replay"):
        generate_in_segments(engine, _requests(), SamplingSettings(), segment_tokens=4, boundary=lambda s: 0)
    assert engine.calls == []  # every refusal before the first engine call


def test_the_wrapper_asks_its_gate_per_call_and_segment_and_keeps_the_engine_otherwise():
    engine = ScriptedEngine({(1, 0): 5, (3, 0): 1})
    engine.marker = "inner"
    asked = []

    class Gate:
        def boundary(self, call, segment):
            asked.append((call, segment))
            return 10 * call + segment

    wrapped = SegmentedEngine(engine, 4, Gate())
    wrapped.generate(_requests(), SamplingSettings(max_new_tokens=8))
    wrapped.generate(_requests()[1:], SamplingSettings(max_new_tokens=8))
    assert asked == [(0, 0), (0, 1), (1, 0)] and wrapped.calls == [[0, 1], [10]]
    assert wrapped.marker == "inner" and wrapped.inner is engine


@pytest.mark.parametrize("overrides, message", [
    (["distributed.backend=ray"], "needs the asynchronous Ray mode"),  # max_staleness 0: nothing arrives mid-batch
    ([], "needs the asynchronous Ray mode"),  # one process
    (["distributed.backend=ray", "distributed.max_staleness=1", "rollout.stop=[END]"], "rollout.stop"),
    (["distributed.backend=ray", "distributed.max_staleness=1", "rollout.routing_replay=record"], "routing_replay"),
])
def test_the_config_refuses_partial_rollouts_where_they_cannot_work(overrides, message):
    from mmrlhf.config import build_config

    with pytest.raises(ValueError, match=message):
        build_config({}, ["rollout.partial=true", *overrides])
    build_config({}, ["rollout.partial=true", "distributed.backend=ray", "distributed.max_staleness=1"])
    # multi-turn rollouts continue across updates too (tests/launch/test_partial_holder.py)
    build_config({}, ["rollout.partial=true", "distributed.backend=ray", "distributed.max_staleness=1",
                      "rollout.kind=agent", "agent.tools=[calculator]"])
