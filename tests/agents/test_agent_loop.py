"""The turn loop (mmrlhf.agents.rollout) over a scripted engine: token in / token out, observation tokens equal one
render of the whole conversation by the chat template, every failure an observation or a marked ending, counted."""

from __future__ import annotations

import time

import pytest
import torch
from PIL import Image

from mmrlhf.agents.loop_types import AgentLimits
from mmrlhf.agents.rollout import AgentLoop
from mmrlhf.agents.runner import ToolRunner
from mmrlhf.agents.tools import Tool, build_tools
from mmrlhf.agents.types import ToolContext
from mmrlhf.experience.agent_rows import encoder_of
from mmrlhf.rollout.types import Completion, GenerationOutput, GenerationResult, SamplingSettings
from mmrlhf.testing.tiny_models import TOY_CALLS

from agent_testing import ZOOM_SCHEMA, Colours, load_tools_model


class ScriptedEngine:
    """Answers request ``record#k`` with the next scripted turn of trajectory ``k`` (the first turn's ``n``
    completions are trajectories k .. k+n-1); records every request it saw."""

    max_model_len = 512

    def __init__(self, scripts: dict[int, list[list[int]]], *, drop_pad_at_turn: int | None = None) -> None:
        self.scripts = scripts
        self.drop_pad_at_turn = drop_pad_at_turn  # echo ids missing one image pad from this turn on (the control)
        self.turn = {k: 0 for k in scripts}
        self.requests: list = []

    def generate(self, requests, settings):
        outputs = []
        for i, req in enumerate(requests):
            self.requests.append((req, settings))
            k = int(req.request_id.rsplit("#", 1)[1])
            completions = []
            for j in range(settings.n):
                script = self.scripts[k + j]
                tokens = script[self.turn[k + j]][: settings.max_new_tokens]
                self.turn[k + j] += 1
                done = bool(tokens) and tokens[-1] in settings.stop_token_ids + (EOS[0],)
                completions.append(Completion(list(tokens), [-0.25] * len(tokens), "stop" if done else "length"))
            echo = list(req.prompt_token_ids)
            if self.drop_pad_at_turn is not None and self.turn[k] > self.drop_pad_at_turn:
                echo.remove(PAD[0])  # as an engine whose vision expansion lost one token would
            outputs.append(GenerationOutput(i, echo, completions))
        return GenerationResult(outputs)


EOS = [0]
PAD = [0]


@pytest.fixture(scope="module")
def tiny():
    model, processor, adapter, data = load_tools_model("qwen2_vl")
    EOS[0] = processor.tokenizer.eos_token_id
    PAD[0] = adapter.image_token_id
    return processor, adapter, data


def _ids(tok, *pieces):
    out = []
    for p in pieces:
        tid = tok.convert_tokens_to_ids(p)
        out.extend([tid] if tid is not None and tid != tok.unk_token_id and p in tok.get_vocab()
                   else tok(p, add_special_tokens=False)["input_ids"])
    return out


def _loop(tiny, engine, *, tools=None, environment=None, limits=None, timeout=5.0, max_pixels=10**7):
    processor, adapter, data = tiny
    tools = build_tools(["image_zoom"]) if tools is None and environment is None else tools
    runner = ToolRunner(tools or {}, workers=4, timeout_s=timeout, max_image_pixels=max_pixels)
    return AgentLoop(engine, processor.tokenizer, adapter, encoder_of(data), limits or AgentLimits(max_turns=3),
                     [processor.tokenizer.eos_token_id], runner, tools=tools, environment=environment)


def _batch(data, n, images=None):
    image = images or Image.new("RGB", (112, 112), (200, 40, 40))
    return data.process_multimodal_batch(["<image>What color?"], [[image]], ["red"], n_samples_per_prompt=n,
                                         record_ids=["rec"])


def _context(batch, image):
    grid = batch.all_vision_inputs[0]["image_grid_thw"]
    return ToolContext(record={"id": "rec", "reference": "red"}, images=[image],
                       model_image_sizes=[(int(g[2]) * 14, int(g[1]) * 14) for g in grid])


def test_two_calls_then_an_answer_match_one_render_of_the_conversation(tiny):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    call = _ids(tok, "<tool_call>", TOY_CALLS[0], "</tool_call>")
    answer = _ids(tok, "red", "<|im_end|>")
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 2, image)
    engine = ScriptedEngine({0: [call, call, answer], 1: [answer]})
    loop = _loop(tiny, engine)
    result = loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=8, seed=1), [_context(batch, image)])
    first, second = result.samples
    assert first.trajectory.ended == "answer" and first.trajectory.num_tool_calls == 2
    assert second.trajectory.num_tool_calls == 0 and second.finished
    # Append-only: each request of trajectory 0 extends the previous one by its turn and an observation.
    seen = [req.prompt_token_ids for req, _ in engine.requests if req.request_id.endswith("#0")]
    assert all(b[: len(a)] == a for a, b in zip(seen, seen[1:])) and len(seen) == 3
    # One render of the whole conversation by the tiny tool model's template gives the same ids.
    zoom = {"type": "function", "function": {"name": "image_zoom", "arguments": {"bbox_2d": [0, 0, 500, 500]}}}
    t_obs = [t for t in first.trajectory.turns if t.role == "tool"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]},
                {"role": "assistant", "content": "", "tool_calls": [zoom]},
                {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": t_obs[0].text}]},
                {"role": "assistant", "content": "", "tool_calls": [zoom]},
                {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": t_obs[1].text}]},
                {"role": "assistant", "content": "red"}]
    full = processor.apply_chat_template(messages, tools=[ZOOM_SCHEMA], tokenize=False)
    rendered = tok(full, add_special_tokens=False)["input_ids"]
    ours = first.prompt_ids + first.response_ids
    collapsed = adapter.collapse_vision_pads(ours)
    assert collapsed == rendered[: len(collapsed)]
    assert rendered[len(collapsed):] == _ids(tok, "\n")  # the template's glue after the last <|im_end|>
    # Policy tokens are exactly the scripted turns; observation tokens carry no engine log-prob.
    mask = torch.tensor(first.policy_mask, dtype=torch.bool)
    assert torch.tensor(first.response_ids)[mask].tolist() == call + call + answer
    assert all(lp == 0.0 for lp, m in zip(first.engine_logprobs, first.policy_mask) if not m)
    # Vision: the prompt's image then the two crops, in pad order.
    assert first.vision["image_grid_thw"].shape[0] == 3
    pads = sum(1 for t in ours if t == adapter.image_token_id)
    assert pads == int(adapter.tokens_per_grid(first.vision["image_grid_thw"]).sum())
    assert result.metrics["agent/tool_calls/mean"] == 1.0 and result.metrics["agent/calls/image_zoom/count"] == 2


class Raising(Tool):
    name, description = "explode", "raises"
    parameters = {"type": "object", "properties": {}}

    def __call__(self, arguments, context):
        raise RuntimeError("boom")


class Sleepy(Tool):
    name, description = "sleepy", "hangs"
    parameters = {"type": "object", "properties": {}}

    def __call__(self, arguments, context):
        time.sleep(3.0)
        return "late"


class Huge(Tool):
    name, description = "huge", "returns a large image"
    parameters = {"type": "object", "properties": {}}

    def __call__(self, arguments, context):
        return Image.new("RGB", (400, 400))


def _call_ids(tok, body: str):
    return _ids(tok, "<tool_call>") + tok(body, add_special_tokens=False)["input_ids"] + _ids(tok, "</tool_call>")


def test_every_failure_is_an_observation_and_counted(tiny):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    answer = _ids(tok, "red", "<|im_end|>")
    scripts = {
        0: [_call_ids(tok, "{not json"), answer],
        1: [_call_ids(tok, '{"name": "nope", "arguments": {}}'), answer],
        2: [_call_ids(tok, '{"name": "image_zoom", "arguments": {"bbox_2d": "x"}}'), answer],
        3: [_call_ids(tok, '{"name": "explode", "arguments": {}}'), answer],
        4: [_call_ids(tok, '{"name": "sleepy", "arguments": {}}'), answer],
        5: [_call_ids(tok, '{"name": "huge", "arguments": {}}'), answer],
    }
    tools = {**build_tools(["image_zoom"]), "explode": Raising(), "sleepy": Sleepy(), "huge": Huge()}
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 6, image)
    loop = _loop(tiny, ScriptedEngine(scripts), tools=tools, timeout=0.5, max_pixels=300 * 300)
    t0 = time.perf_counter()
    result = loop.run(batch, 6, SamplingSettings(n=6, max_new_tokens=64), [_context(batch, image)])
    assert time.perf_counter() - t0 < 2.5  # the hung tool does not hold the step past its deadline
    kinds = [s.trajectory.errors for s in result.samples]
    assert kinds == [["bad_json"], ["unknown_tool"], ["bad_arguments"], ["tool_raised"], ["timeout"],
                     ["image_too_large"]]
    for s in result.samples:  # the model read an error message and answered: nothing ended early or crashed
        assert s.trajectory.ended == "answer" and s.trajectory.turns[1].text.startswith("Error")
        assert s.vision["image_grid_thw"].shape[0] == 1  # no image was added by a failed call
    m = result.metrics
    for kind in ("bad_json", "unknown_tool", "bad_arguments", "tool_raised", "timeout", "image_too_large"):
        assert m[f"agent/errors/{kind}/count"] == 1.0
    assert m["agent/errors/mean"] == 1.0


class Slow(Tool):
    name, description = "slow", "answers after 0.4 s"
    parameters = {"type": "object", "properties": {}}

    def __call__(self, arguments, context):
        time.sleep(0.4)
        return "done"


def test_the_long_tail_and_tool_wait_per_trajectory(tiny):
    """Trajectory 0 calls a tool that takes 0.4 s, trajectory 1 answers at once: 1's time ends with its turn and it
    waits on no tool; 0 waits the call out. The engine generated for part of the rollout only."""
    processor, adapter, data = tiny
    tok = processor.tokenizer
    answer = _ids(tok, "red", "<|im_end|>")
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 2, image)
    engine = ScriptedEngine({0: [_call_ids(tok, '{"name": "slow", "arguments": {}}'), answer], 1: [answer]})
    loop = _loop(tiny, engine, tools={"slow": Slow()})
    m = loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=64), [_context(batch, image)]).metrics
    assert 0.2 <= m["agent/tool_wait_s/mean"] < 0.2 + 0.5  # (0.4 + 0) / 2, with the thread's own overhead
    assert m["agent/trajectory_s/max"] >= 0.4 > m["agent/trajectory_s/p50"]  # p50 of two: the shorter
    assert m["agent/trajectory_s/p95"] == m["agent/trajectory_s/max"]
    assert 0.0 < m["agent/engine_busy_frac"] < 0.5


def test_budgets_end_trajectories_marked_never_cut_an_image(tiny):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    call = _ids(tok, "<tool_call>", TOY_CALLS[0], "</tool_call>")
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 3, image)
    prompt_len = len(batch.all_prompt_token_ids[0])
    # 0: calls every turn until max_turns; 1: one call, then an answer; 2: a turn cut by its cap
    answer = _ids(tok, "red", "<|im_end|>")
    scripts = {0: [call, call, call], 1: [call, answer], 2: [_ids(tok, "red", "red", "red", "red")]}
    limits = AgentLimits(max_turns=2, max_context_tokens=512, max_new_tokens_per_turn=3, max_images=8)
    result = _loop(tiny, ScriptedEngine(scripts), limits=limits).run(
        batch, 3, SamplingSettings(n=3, max_new_tokens=3), [_context(batch, image)])
    ended = [s.trajectory.ended for s in result.samples]
    assert ended == ["max_turns", "answer", "length"]
    assert all(not s.finished for s in result.samples[::2])
    assert result.metrics["agent/out_of_budget_rate"] >= 2 / 3
    # context: the same trajectory with a budget one observation too small ends before the observation
    obs_len = len(result.samples[0].response_ids) - 2 * len(call)
    tight = AgentLimits(max_turns=3, max_context_tokens=prompt_len + len(call) + obs_len, max_new_tokens_per_turn=3)
    engine = ScriptedEngine({0: [call, call], 1: [call, call], 2: [call, call]})
    result = _loop(tiny, engine, limits=tight).run(batch, 3, SamplingSettings(n=3, max_new_tokens=3),
                                                   [_context(batch, image)])
    s = result.samples[1]
    assert s.trajectory.ended == "context" and s.response_ids == call and s.vision["image_grid_thw"].shape[0] == 1


def test_images_past_the_cap_become_an_error_observation(tiny):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    call = _ids(tok, "<tool_call>", TOY_CALLS[0], "</tool_call>")
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 1, image)
    limits = AgentLimits(max_turns=3, max_images=2, max_new_tokens_per_turn=8)
    result = _loop(tiny, ScriptedEngine({0: [call, call, _ids(tok, "red", "<|im_end|>")]}), limits=limits).run(
        batch, 1, SamplingSettings(n=1, max_new_tokens=8), [_context(batch, image)])
    s = result.samples[0]
    assert s.trajectory.errors == ["too_many_images"] and s.vision["image_grid_thw"].shape[0] == 2
    assert result.metrics["agent/errors/too_many_images/count"] == 1.0


def test_an_environment_answers_every_turn_with_images(tiny):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    turn = _ids(tok, "blue", "<|im_end|>")
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 2, image)
    loop = _loop(tiny, ScriptedEngine({0: [turn] * 4, 1: [turn] * 4}), environment=Colours,
                 limits=AgentLimits(max_turns=4, max_new_tokens_per_turn=8))
    result = loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=8), [_context(batch, image)])
    for s in result.samples:
        assert s.trajectory.ended == "done" and s.trajectory.info == {"solved": True}
        assert s.vision["image_grid_thw"].shape[0] == 4  # the prompt's, reset's and two step images
        assert s.trajectory.num_turns == 3


class Sessions(Colours):
    """Colours that counts its live sessions (made, not yet closed) across instances."""

    live = most = 0

    def __init__(self) -> None:
        super().__init__()
        Sessions.live += 1
        Sessions.most = max(Sessions.most, Sessions.live)

    def close(self) -> None:
        Sessions.live -= 1


@pytest.mark.parametrize("limit, most", [(None, 6), (3, 2), (1, 2)])
def test_waves_bound_the_live_sessions_and_keep_the_trajectories(tiny, limit, most):
    """Three prompts of two samples under ``max_concurrent_trajectories``: whole groups per wave (3 -> one group of
    2; 1 -> still one group), every session closed before the next wave opens, the same samples in step order."""
    processor, adapter, data = tiny
    tok = processor.tokenizer
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = data.process_multimodal_batch(["<image>What color?"] * 3, [[image]] * 3, ["red"] * 3,
                                          n_samples_per_prompt=2, record_ids=["a", "b", "c"])
    turns = {k: [_ids(tok, ("blue", "red", "green")[k % 3], "<|im_end|>")] * 4 for k in range(6)}
    Sessions.live = Sessions.most = 0
    loop = _loop(tiny, ScriptedEngine(turns), environment=Sessions,
                 limits=AgentLimits(max_turns=4, max_new_tokens_per_turn=8, max_concurrent_trajectories=limit))
    result = loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=8), [_context(batch, image)] * 3)
    assert Sessions.most == most and Sessions.live == 0
    assert [s.sample_index for s in result.samples] == list(range(6))
    assert [s.group for s in result.samples] == [0, 0, 1, 1, 2, 2]
    assert all(s.trajectory.ended == "done" for s in result.samples)
    for s in result.samples:  # each trajectory's policy tokens are its own script's, whatever wave it ran in
        policy = [t for t, m in zip(s.response_ids, s.policy_mask) if m]
        assert policy == turns[s.sample_index][0] * s.trajectory.num_turns


def test_an_environment_factory_that_raises_fails_its_trajectory_only(tiny, caplog):
    """The factory is user code run once per trajectory: one that raises (a sandbox that did not start; here
    ``sys.exit`` for the second trajectory) fails that trajectory as a failed reset does: counted as
    ``tool_raised`` and ``reset_failed``, ended before its first turn, so left out (no turn answers an error that
    is not the task's); the other trajectory runs its episode. A factory making something that is not an
    environment (a spec error, the same for every trajectory) still stops the step."""
    import sys

    from mmrlhf.agents.environment import EnvironmentSpecError

    processor, adapter, data = tiny
    tok = processor.tokenizer
    turn = _ids(tok, "blue", "<|im_end|>")
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 2, image)
    made = []

    def factory():
        made.append(1)
        if len(made) == 2:
            sys.exit("sandbox pool exhausted")
        return Colours()

    loop = _loop(tiny, ScriptedEngine({0: [turn] * 4, 1: [turn] * 4}), environment=factory,
                 limits=AgentLimits(max_turns=4, max_new_tokens_per_turn=8))
    result = loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=8), [_context(batch, image)])
    (good,) = result.samples
    assert good.sample_index == 0
    assert good.trajectory.ended == "done" and good.trajectory.info == {"solved": True} and not good.trajectory.errors
    m = result.metrics
    assert m["agent/errors/tool_raised/count"] == 1.0 and m["agent/ended/reset_failed/count"] == 1.0
    assert m["agent/ended/before_first_turn/count"] == 1.0
    assert not [req for req, _ in loop.engine.requests if req.request_id.endswith("#1")]  # never generated for
    assert "record 'rec'): its environment's reset failed (Error: the environment could not be created " \
        "(SystemExit: sandbox pool exhausted))" in caplog.text

    def not_an_environment():
        raise EnvironmentSpecError("environment 'x:Y' made a dict without reset() / step()")

    loop = _loop(tiny, ScriptedEngine({0: [turn], 1: [turn]}), environment=not_an_environment)
    with pytest.raises(EnvironmentSpecError, match="without reset"):
        loop.run(batch, 2, SamplingSettings(n=2, max_new_tokens=8), [_context(batch, image)])


class Big(Tool):
    name, description = "big", "returns a large image"
    parameters = {"type": "object", "properties": {}}

    def __call__(self, arguments, context):
        return Image.new("RGB", (448, 224), (9, 99, 199))


class Sizes(Tool):
    name, description = "sizes", "reports the images it can see"
    parameters = {"type": "object", "properties": {}}

    def __call__(self, arguments, context):
        return "; ".join(f"{im.size}->{ms}" for im, ms in zip(context.images, context.model_image_sizes))


def test_later_calls_see_tool_images_at_full_resolution_with_their_model_sizes(tiny):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 1, image)
    scripts = {0: [_call_ids(tok, '{"name": "big", "arguments": {}}'),
                   _call_ids(tok, '{"name": "sizes", "arguments": {}}'), _ids(tok, "red", "<|im_end|>")]}
    result = _loop(tiny, ScriptedEngine(scripts), tools={"big": Big(), "sizes": Sizes()}).run(
        batch, 1, SamplingSettings(n=1, max_new_tokens=64), [_context(batch, image)])
    s = result.samples[0]
    report = s.trajectory.turns[3].text
    grid = s.vision["image_grid_thw"]
    prompt_size, model_size = ((int(g[2]) * 14, int(g[1]) * 14) for g in grid[:2])
    assert report == f"(112, 112)->{prompt_size}; (448, 224)->{model_size}"  # the tool's image as returned
    assert model_size[0] < 448  # the processor resized it for the model; a later zoom still crops the original


def test_an_engine_that_saw_other_ids_is_an_error_naming_the_turn(tiny):
    processor, adapter, data = tiny
    tok = processor.tokenizer
    call = _ids(tok, "<tool_call>", TOY_CALLS[0], "</tool_call>")
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    batch = _batch(data, 1, image)
    engine = ScriptedEngine({0: [call, _ids(tok, "red", "<|im_end|>")]}, drop_pad_at_turn=1)
    with pytest.raises(ValueError, match=r"record 'rec', trajectory 0, turn 2: the engine's prompt ids differ"):
        _loop(tiny, engine).run(batch, 1, SamplingSettings(n=1, max_new_tokens=8), [_context(batch, image)])


def _first_word(responses, prompts, labels, references):
    return [float(r.split()[:1] == [ref]) for r, ref in zip(responses, references)]


def test_evaluation_reports_the_agent_metrics_under_eval(tiny):
    """The held-out evaluation through an agent maker logs the step's ``agent/*`` metrics as ``eval/agent/*``: one
    of two greedy trajectories calls the zoom tool, so the eval's tool-use rate is 0.5."""
    from mmrlhf.data.stream import record_columns
    from mmrlhf.data.types import PromptRecord
    from mmrlhf.experience.fast_maker import FastExperienceMaker
    from mmrlhf.experience.kinds import AgentKind, KindSetup
    from mmrlhf.experience.settings import ExperienceSettings
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.rewards.engine import RewardComputationEngine
    from mmrlhf.rewards.sources import FunctionSource
    from mmrlhf.testing.tiny_models import tiny_model_dir
    from mmrlhf.trainer.evaluation import Evaluator

    processor, adapter, data = tiny
    tok = processor.tokenizer
    call, answer = _ids(tok, "<tool_call>", TOY_CALLS[0], "</tool_call>"), _ids(tok, "red", "<|im_end|>")
    engine = ScriptedEngine({0: [call, answer], 1: [answer]})
    actor = ActorVL.from_pretrained(str(tiny_model_dir("qwen2_vl", tools=True)), dtype=torch.float32)
    rewards = RewardComputationEngine({"first": FunctionSource(_first_word, name="first")}, {},
                                      default_recipe=[("first", 1.0)])
    maker = FastExperienceMaker(actor, engine, data, rewards, tok, ExperienceSettings(n_samples_per_prompt=1),
                                SamplingSettings(max_new_tokens=8, seed=0),
                                kind=AgentKind(KindSetup(_loop(tiny, engine))))
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    records = [PromptRecord(i, "<image>What color?", images=[image], reference="red", record_id="rec")
               for i in range(2)]
    out = Evaluator(maker, records).run()
    assert out["eval/agent/tool_use_rate"] == 0.5 and out["eval/agent/tool_calls/mean"] == 0.5
    assert out["eval/agent/calls/image_zoom/count"] == 1.0 and out["eval/agent/turns/mean"] == 1.5
    assert out["eval/reward/mean"] == 1.0
    # The same names a training step logs, under eval/ (the script replayed from its start).
    engine.turn = {k: 0 for k in engine.scripts}
    step = maker.generate_rollout(**record_columns(records), n=1).metrics
    assert {k for k in out if k.startswith("eval/agent/")} == {f"eval/{k}" for k in step if k.startswith("agent/")}
