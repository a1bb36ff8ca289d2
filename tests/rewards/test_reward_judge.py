"""The ``judge`` reward source: rubric rendering, verdict scoring, cache, failure entries, the endpoint client's
retries, and end to end against a real ``vllm serve`` of a tiny judge whose verdicts are known by construction
(:func:`judge_testing.build_keyword_judge`: ``yes`` when the prompt holds the right colour word ``red``, ``no``
for ``blue``)."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import yaml
from PIL import Image

from mmrlhf.config.reward import RewardConfig
from mmrlhf.rewards.engine import RewardComputationEngine
from mmrlhf.rewards.judge.backends import EndpointJudge, JudgeCallError, JudgeReply, parse_chat_completion
from mmrlhf.rewards.judge.rubric import (DEFAULT_RUBRIC, compile_rubric, load_rubric, question_from_prompt,
                                         render_request)
from mmrlhf.rewards.judge.source import JudgeSource
from mmrlhf.rewards.judge.verdict import (VerdictError, parse_number, parse_verdict, score_output,
                                          verdict_probability)
from mmrlhf.rewards.types import RewardBatch, RewardError

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What color is the square?<|im_end|>\n"
          "<|im_start|>assistant\n")
RED = Image.new("RGB", (56, 56), (255, 0, 0))
BLUE = Image.new("RGB", (56, 56), (0, 0, 255))


def batch(responses, references=None, images=None, labels=None) -> RewardBatch:
    n = len(responses)
    return RewardBatch(responses=list(responses), prompts=[PROMPT] * n, labels=labels or ["vqa"] * n,
                       references=list(references or [None] * n), images=images)


# ---- rubric --------------------------------------------------------------------------------------------------
def test_rubric_renders_question_reference_final_answer_and_places_images():
    request = render_request(compile_rubric(DEFAULT_RUBRIC), question=question_from_prompt(PROMPT), reference="red",
                             response="<think>blue? no</think> red", prompt=PROMPT, images=[RED])
    assert "Question: What color is the square?" in request.text
    assert "Reference answer: red" in request.text
    assert "Answer to grade: red\n" in request.text and "blue" not in request.text  # thinking stripped
    assert request.content[0]["type"] == "image_url"
    assert request.content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert [p["type"] for p in request.content] == ["image_url", "text"]
    no_ref = render_request(compile_rubric(DEFAULT_RUBRIC), question="q", reference=None, response="red",
                            prompt="", images=[])
    assert "Reference" not in no_ref.text and no_ref.content == [{"type": "text", "text": no_ref.text}]


def test_rubric_places_images_where_the_template_prints_them_and_prepends_the_rest():
    template = compile_rubric("A {{ images[1] }} B {{ answer }}")
    request = render_request(template, question="q", reference=None, response="x", prompt="", images=[RED, BLUE])
    kinds = [p["type"] if p["type"] != "text" else p["text"] for p in request.content]
    assert kinds == ["image_url", "A ", "image_url", " B x"]
    assert request.content[0]["image_url"] != request.content[2]["image_url"]  # image 0 first, image 1 inside
    with pytest.raises(Exception, match="questoin"):  # StrictUndefined: a misspelled variable is an error
        render_request(compile_rubric("{{ questoin }}"), question="q", reference=None, response="", prompt="",
                       images=[])


def test_rubric_from_file_and_missing_file(tmp_path):
    path = tmp_path / "rubric.j2"
    path.write_text("Grade {{ answer }}")
    assert load_rubric(str(path)) == "Grade {{ answer }}"
    assert load_rubric("") == DEFAULT_RUBRIC
    assert load_rubric("inline {{ answer }}") == "inline {{ answer }}"
    with pytest.raises(FileNotFoundError, match="missing.j2"):
        load_rubric(str(tmp_path / "missing.j2"))


def test_question_from_prompt_takes_the_last_user_turn_without_vision_blocks():
    assert question_from_prompt(PROMPT) == "What color is the square?"
    assert question_from_prompt("plain question") == "plain question"


# ---- verdicts ------------------------------------------------------------------------------------------------
def test_parse_verdict_first_word_whole_word_after_thinking():
    yes_no = {"yes": 1.0, "no": 0.0}
    assert parse_verdict("<think>no, wait</think>Yes, it is.", yes_no) == (1.0, "yes")
    assert parse_verdict("No. (yes would be wrong)", yes_no) == (0.0, "no")
    graded = {"correct": 1.0, "incorrect": 0.0}
    assert parse_verdict("The answer is incorrect.", graded) == (0.0, "incorrect")
    with pytest.raises(VerdictError, match="no verdict word"):
        parse_verdict("nobody knows", yes_no)  # "no" inside a word does not count


def test_parse_number_last_number_in_range_scaled():
    assert parse_number("Step 1 ... score: 7", (0.0, 10.0)) == (0.7, "7")
    assert parse_number("<think>maybe 2</think>8.5", (0.0, 10.0))[0] == pytest.approx(0.85)
    with pytest.raises(VerdictError, match="outside score_range"):
        parse_number("11", (0.0, 10.0))
    with pytest.raises(VerdictError, match="no number"):
        parse_number("great", (0.0, 10.0))


def test_verdict_probability_oracle():
    top = {"yes": math.log(0.5), " yes": math.log(0.1), "no": math.log(0.2), "maybe": math.log(0.2)}
    score, verdict = verdict_probability(top, {"yes": 1.0, "no": 0.0})
    assert score == pytest.approx(0.6 / 0.8) and verdict == "yes"
    three = verdict_probability({"A": math.log(0.2), "B": math.log(0.2)}, {"a": 1.0, "b": 0.5, "c": 0.0})
    assert three[0] == pytest.approx(0.75)
    with pytest.raises(VerdictError, match="no verdict token"):
        verdict_probability({"maybe": 0.0}, {"yes": 1.0, "no": 0.0})
    with pytest.raises(VerdictError, match="needs the first token"):
        score_output("verdict_prob", "yes", None, {"yes": 1.0}, (0, 1))


# ---- the source with a scripted backend ----------------------------------------------------------------------
class ScriptedJudge:
    """Answers by a function of the request text; records what it was asked."""

    def __init__(self, answer):
        self.answer = answer
        self.asked: list[str] = []

    async def run(self, requests):
        self.asked.extend(r.text for r in requests)
        out = []
        for r in requests:
            try:
                out.append(self.answer(r.text))
            except Exception as exc:  # noqa: BLE001 - handed back as that request's failure, as backends do
                out.append(exc)
        return out


def _yes_if_red(text: str) -> JudgeReply:
    answer = text.split("Answer to grade:")[1]
    if "boom" in answer:
        raise JudgeCallError("judge endpoint http://x/v1/chat/completions failed after 5 attempts: HTTP 503")
    if "garbage" in answer:
        return JudgeReply(text="hmm", top_logprobs={"hmm": 0.0}, latency_s=0.1)
    p = 0.9 if "red" in answer else 0.2
    return JudgeReply(text="yes" if p > 0.5 else "no", top_logprobs={"yes": math.log(p), "no": math.log(1 - p)},
                      latency_s=0.1)


def test_source_scores_caches_dedupes_and_reports_parts():
    judge = ScriptedJudge(_yes_if_red)
    source = JudgeSource(judge, name="judge", judge_id="scripted", rubric=DEFAULT_RUBRIC)
    data = batch(["red", "blue", "<think>blue</think>red"], images=[[RED], [RED], [RED]])
    out = asyncio.run(source.score(data))
    assert out.scores == pytest.approx([0.9, 0.2, 0.9]) and out.errors == [None] * 3
    assert len(judge.asked) == 2  # samples 0 and 2 render alike (thinking stripped): asked once
    assert out.parts["verdict_yes"] == [1.0, 0.0, 1.0] and out.parts["parse_failed"] == [0.0] * 3
    assert source.last_outputs == {0: "yes", 1: "no", 2: "yes"}
    again = asyncio.run(source.score(data))
    assert again.scores == out.scores and len(judge.asked) == 2
    assert again.parts["cache_hit"] == [1.0] * 3 and again.parts["latency_s"] == [None] * 3
    other_image = asyncio.run(source.score(batch(["red"], images=[[BLUE]])))  # images are part of the key
    assert other_image.scores == pytest.approx([0.9]) and len(judge.asked) == 3


def test_each_image_is_encoded_once_per_scoring_call(monkeypatch):
    """The samples of a group share their prompt's image objects: one PNG each, one part object for the group."""
    from mmrlhf.rewards.judge import rubric

    encoded: list[int] = []
    real = rubric.encode_image
    monkeypatch.setattr(rubric, "encode_image", lambda image, **kw: encoded.append(id(image)) or real(image, **kw))
    copy = RED.copy()  # the same pixels in another object: encoded again, with the same digest
    judge = ScriptedJudge(_yes_if_red)
    source = JudgeSource(judge, name="judge", judge_id="j", rubric=DEFAULT_RUBRIC)
    asked = []
    judge.run = lambda requests, run=judge.run: asked.extend(requests) or run(requests)
    data = batch([f"red {i}" for i in range(9)], images=[[RED]] * 8 + [[copy]])
    out = asyncio.run(source.score(data))
    assert out.errors == [None] * 9 and len(asked) == 9
    assert encoded == [id(RED), id(copy)]  # 2 encodes for 9 samples, not 9
    assert all(r.content[0] is asked[0].content[0] for r in asked[:8])
    assert asked[8].image_digests == asked[0].image_digests  # same pixels, same part of the cache key


def test_source_failures_name_the_sample_and_follow_the_failure_policy():
    source = JudgeSource(ScriptedJudge(_yes_if_red), name="judge", judge_id="scripted", rubric=DEFAULT_RUBRIC)
    data = batch(["red", "garbage", "boom"])
    out = asyncio.run(source.score(data))
    assert out.scores[0] == pytest.approx(0.9) and out.scores[1:] == [None, None]
    assert "sample 1 (label 'vqa')" in out.errors[1] and "no verdict token" in out.errors[1]
    assert "sample 2 (label 'vqa')" in out.errors[2] and "HTTP 503" in out.errors[2]
    assert out.parts["parse_failed"] == [0.0, 1.0, None]
    masked = RewardComputationEngine({"judge": source}, {"vqa": [("judge", 1.0)]}, on_failure="mask")
    result = masked.compute(data)
    assert result.valid.tolist() == [True, False, False]
    assert result.metrics["reward/judge/failures"] == 2.0
    assert result.metrics["reward/judge/parse_failed/mean"] == pytest.approx(0.5)
    assert result.notes["judge/text"] == ["yes", "hmm", None]  # the judge's text per sample, for the report
    strict = RewardComputationEngine({"judge": source}, {"vqa": [("judge", 1.0)]}, on_failure="error")
    with pytest.raises(RewardError, match="sample 1"):
        strict.compute(data)


def test_the_judge_text_reaches_the_rollout_report(tmp_path):
    from mmrlhf.trainer.report import ReportSample, write_rollout_report

    sample = ReportSample(prompt=PROMPT, response="red", reward=0.9, advantage=None,
                          notes={"judge/text": "yes <the answer matches>"})
    out = tmp_path / "report.html"
    write_rollout_report([sample], out, step=1)
    assert "judge/text" in out.read_text() and "yes &lt;the answer matches&gt;" in out.read_text()


def test_judge_notes_survive_rollout_select_and_concat_into_the_step_reporter(tmp_path):
    import torch

    from mmrlhf.experience.rollout import Rollout, ScoredRollout
    from mmrlhf.rewards.types import RewardResult
    from mmrlhf.rollout.types import SamplingSettings
    from mmrlhf.trainer.reporting import StepReporter

    def scored(n, notes):
        cols = dict(sample_index=list(range(n)), group=list(range(n)), prompt_ids=[[1]] * n,
                    response_ids=[[2]] * n, engine_logprobs=[None] * n, finished=[True] * n, vision=[{}] * n,
                    prompts=[PROMPT] * n, labels=[None] * n, references=[None] * n, images=[[] for _ in range(n)],
                    record_ids=[None] * n)
        rewards = RewardResult(rewards=torch.ones(n), valid=torch.ones(n, dtype=torch.bool), sources={}, parts={},
                               metrics={}, notes=notes)
        return ScoredRollout(Rollout(**cols), rewards, SamplingSettings())

    joined = ScoredRollout.concat([scored(2, {"judge/text": ["yes", None]}), scored(1, {})])
    assert joined.rewards.notes == {"judge/text": ["yes", None, None]}
    picked = joined.select([2, 0])
    assert picked.rewards.notes == {"judge/text": [None, "yes"]}

    class Tok:
        def batch_decode(self, ids, skip_special_tokens):
            return ["red" for _ in ids]

    samples = StepReporter(tmp_path, Tok()).samples(picked, [])
    assert [s.notes for s in samples] == [{}, {"judge/text": "yes"}]


def test_config_type_judge_validates_and_builds():
    cfg = RewardConfig(label_map={"judge": {"type": "judge", "model": "tiny", "url": "http://127.0.0.1:1/v1"}},
                       recipe={"vqa": [("judge", 1.0)]})
    judge = cfg.label_map["judge"]
    assert (judge.scoring, judge.verdicts, judge.backend, judge.cache_size) == (
        "verdict_prob", {"yes": 1.0, "no": 0.0}, "endpoint", 4096)
    engine = RewardComputationEngine.from_config(cfg)
    assert isinstance(engine.sources["judge"], JudgeSource)
    with pytest.raises(ValueError, match="needs url"):
        RewardConfig(label_map={"j": {"type": "judge", "model": "tiny"}})
    with pytest.raises(ValueError, match=r"(?s)verdicts.*quote them"):  # YAML's {yes: 1, no: 0} has boolean keys
        RewardConfig(label_map={"j": {"type": "judge", "model": "m", "url": "http://h/v1",
                                      "verdicts": yaml.safe_load("{yes: 1.0, no: 0.0}")}})
    with pytest.raises(ValueError, match="lo < hi"):
        RewardConfig(label_map={"j": {"type": "judge", "model": "m", "url": "http://h/v1", "score_range": [5, 1]}})


def test_config_ray_backend_builds_lazily_and_its_resources_are_refused_by_key(monkeypatch):
    from types import SimpleNamespace

    from mmrlhf.launch.ray.driver import _check_judges
    from mmrlhf.launch.ray.runtime import ActorSlot, PlacementPlan
    from mmrlhf.rewards.judge.ray_actor import RayActorJudge, actor_resources

    judge = {"type": "judge", "backend": "ray", "model": "/models/judge", "engine": {"tensor_parallel_size": 2}}
    cfg = RewardConfig(label_map={"judge": judge}, recipe={"vqa": [("judge", 1.0)]})
    source = RewardComputationEngine.from_config(cfg).sources["judge"]
    assert isinstance(source.backend, RayActorJudge) and source.backend._handle is None  # no Ray until scoring
    assert actor_resources("judge", cfg.label_map["judge"], 8.0) == (1.0, 2.0)  # auto: the engine's GPUs
    assert actor_resources("judge", cfg.label_map["judge"], 0.0) == (1.0, 0.0)  # a CPU cluster
    on_gpu = RewardConfig(label_map={"judge": {**judge, "actor_gpus": 1}})
    with pytest.raises(ValueError, match=r"reward\.label_map\.judge\.actor_gpus=1 but the Ray cluster has no GPUs"):
        actor_resources("judge", on_gpu.label_map["judge"], 0.0)
    full = PlacementPlan(rollout=(ActorSlot(1, 4, 0),), trainer=(ActorSlot(1, 3, 1),))  # 7 of 8 GPUs taken
    with pytest.raises(ValueError, match=r"reward\.label_map\.judge\.actor_gpus=2, but the cluster has 8"):
        _check_judges(SimpleNamespace(reward=cfg), full, 8.0)
    _check_judges(SimpleNamespace(reward=on_gpu), full, 8.0)  # 7 + 1 fit
    with pytest.raises(ValueError, match="sleep: true is for backend 'vllm'"):
        RewardConfig(label_map={"j": {**judge, "sleep": True}})
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun ranks without a shared Ray: one engine each, refused
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"reward\.label_map\.judge\.backend=ray under torchrun.*RAY_ADDRESS"):
        RewardComputationEngine.from_config(cfg)


# ---- the endpoint client -------------------------------------------------------------------------------------
def _completion(text: str, top: dict[str, float]) -> dict:
    return {"choices": [{"message": {"content": text}, "logprobs": {"content": [
        {"token": text, "logprob": max(top.values()), "top_logprobs": [{"token": t, "logprob": v}
                                                                        for t, v in top.items()]}]}}]}


def test_endpoint_retries_busy_answers_and_refuses_bad_requests():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(503, text="busy")
        return httpx.Response(200, json=_completion("yes", {"yes": -0.1, "no": -2.5}))

    judge = EndpointJudge("http://judge/v1", "m", max_tokens=4, top_logprobs=5, backoff_s=0.0,
                          transport=httpx.MockTransport(handler))
    request = render_request(compile_rubric(DEFAULT_RUBRIC), question="q", reference=None, response="red",
                             prompt="", images=[RED])
    [reply] = asyncio.run(judge.run([request]))
    assert isinstance(reply, JudgeReply) and reply.text == "yes" and reply.top_logprobs["no"] == -2.5
    assert len(calls) == 3 and str(calls[0].url) == "http://judge/v1/chat/completions"
    body = judge.body(request)
    assert body["temperature"] == 0.0 and body["logprobs"] is True and body["top_logprobs"] == 5
    assert "chat_template_kwargs" not in body  # only sent when set: other OpenAI-compatible servers may refuse it

    refused = EndpointJudge("http://judge/v1", "m", max_tokens=4, top_logprobs=5, backoff_s=0.0,
                            transport=httpx.MockTransport(lambda r: httpx.Response(400, text="bad image")))
    [error] = asyncio.run(refused.run([request]))
    assert isinstance(error, JudgeCallError) and "HTTP 400: bad image" in str(error)
    with pytest.raises(JudgeCallError, match="malformed"):
        parse_chat_completion({"choices": []}, "http://judge/v1/chat/completions")


# ---- a real vllm serve ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyword_judge_server(tmp_path_factory):
    from judge_testing import VllmServer, build_keyword_judge

    from mmrlhf.testing.tiny_models import tiny_model_dir

    root = tmp_path_factory.mktemp("judge")
    model = build_keyword_judge(tiny_model_dir("qwen2_vl"), root / "keyword-judge", good="red", bad="blue", gain=2.0)
    server = VllmServer(model, name="keyword-judge", log_dir=root)
    yield server
    server.stop()


def _engine(server, **extra) -> RewardComputationEngine:
    judge = {"type": "judge", "model": "keyword-judge", "url": server.base_url, "max_tokens": 2, **extra}
    return RewardComputationEngine.from_config(RewardConfig(label_map={"judge": judge},
                                                            recipe={"vqa": [("judge", 1.0)]}))


@pytest.mark.slow
def test_vllm_serve_judge_scores_the_right_answer_higher_with_a_control(keyword_judge_server, request):
    server = keyword_judge_server
    try:
        right_wrong = batch(["<think>is it blue?</think>red", "blue", "red", "blue"])
        result = _engine(server).compute(right_wrong)
        scores = result.sources["judge"].tolist()
        print(f"\nverdict_prob right/wrong: {scores}")
        assert result.valid.all()
        assert scores[0] > 0.5 > scores[1] and scores[0] == pytest.approx(scores[2], abs=1e-6)
        assert scores[0] - scores[1] > 0.2
        assert result.metrics["reward/judge/verdict_yes/mean"] == 0.5
        assert result.metrics["reward/judge/latency_s/mean"] > 0
        assert result.notes["judge/text"][1].startswith("no")  # the judge's own text, for the report
        # Control: the same judge and samples, with a rubric that does not show the answer: no separation.
        blind = _engine(server, rubric="Question: {{ question }}\nIs the answer correct? yes or no.")
        control = blind.compute(right_wrong).sources["judge"].tolist()
        print(f"verdict_prob with the answer hidden: {control}")
        assert max(control) - min(control) < 1e-6
        # Parsed verdicts from the generated text agree (one token: this judge never stops on its own).
        parsed = _engine(server, scoring="verdict", max_tokens=1).compute(right_wrong).sources["judge"].tolist()
        assert parsed == [1.0, 0.0, 1.0, 0.0]
    except AssertionError:
        print(server.log_tail())
        raise


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_served_judges_template(keyword_judge_server):
    """The tiny judge's template prints the ``judge_hint`` variable: sent in the request body, a hint full of the
    right colour turns the wrong answer's verdict; the same request without it is the control."""
    wrong = batch(["blue"])
    plain = _engine(keyword_judge_server).compute(wrong).sources["judge"].tolist()
    hint = {"judge_hint": " ".join(["red"] * 8)}
    hinted = _engine(keyword_judge_server, chat_template_kwargs=hint).compute(wrong).sources["judge"].tolist()
    print(f"\nwrong answer without / with the red hint: {plain} / {hinted}")
    assert hinted[0] > 0.5 > plain[0]


@pytest.mark.slow
def test_vllm_serve_judge_sees_the_images(keyword_judge_server):
    """Images travel as data URLs and reach the judge: the same text with and without an image scores apart
    (the vision tower's features enter the judge's uniform attention)."""
    source = _engine(keyword_judge_server).sources["judge"]
    with_images = batch(["blue", "blue"], images=[[RED], []])
    out = asyncio.run(source.score(with_images))
    print(f"\nsame answer, with / without an image: {out.scores}; judge text: {source.last_outputs}")
    assert out.errors == [None, None] and abs(out.scores[0] - out.scores[1]) > 1e-4
    assert set(source.last_outputs) == {0, 1}
