"""The ``judge`` reward source: render each sample's rubric, ask the judge (cache first), score its output.

Per sample it reports, besides the score, the parts ``latency_s`` (the judge's time on a request that was sent,
from the send to the answer) and ``queue_s`` (the time it waited to be sent; both absent on a cache hit: see
:class:`~mmrlhf.rewards.judge.backends.JudgeReply`), ``cache_hit`` and ``parse_failed`` (0 / 1), and for verdict
scorings one ``verdict_<word>`` 0 / 1 part per verdict word (their means are the verdict distribution). A sample
whose rubric cannot be rendered, whose request fails for good, or whose output holds no verdict gets an error
naming the source, the sample and what went wrong; the engine's ``reward.on_failure`` then stops the run or masks
and counts the sample, as for every source. The judge's text per sample is its note ``text``
(``RewardResult.notes["<source>/text"]``, shown in the rollout report) and, for the last call, ``last_outputs``
(sample index -> text).

The cache is keyed by (judge, rubric, scoring, rendered text, image digests): the rendered text holds the
question, reference and final answer, so two samples share an entry exactly when the judge would see the same
input. Temperature is 0, so a cached reply is the reply the judge would give again.

Rendering (Jinja, and the PNG encoding of each image, once per image object of the call) runs in a worker thread:
encoding a batch's images takes long enough to stall the other sources' requests if it ran on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from typing import Any, Mapping, Sequence

from mmrlhf.rewards.judge.backends import JudgeReply
from mmrlhf.rewards.judge.rubric import (
    ImageParts,
    JudgeRequest,
    compile_rubric,
    escaper,
    question_from_prompt,
    render_request,
    rubric_digest,
)
from mmrlhf.rewards.judge.verdict import VerdictError, score_output
from mmrlhf.rewards.types import RewardBatch, SourceScores


class JudgeSource:
    """A reward source asking a judge model through ``backend`` (see :mod:`mmrlhf.rewards.judge.backends`)."""

    def __init__(self, backend: Any, *, name: str, judge_id: str, rubric: str, scoring: str = "verdict_prob",
                 verdicts: Mapping[str, float] | None = None, score_range: tuple[float, float] = (0.0, 10.0),
                 question_column: str = "", cache_size: int = 4096, timeout_s: float | None = None,
                 reserved: Sequence[str] = ()) -> None:
        """``reserved``: the judge tokenizer's special tokens, escaped in what the rubric's variables hold
        (:func:`~mmrlhf.rewards.judge.rubric.escape_text`)."""
        self.backend = backend
        self.escape = escaper(reserved)
        self.name = name
        self.judge_id = judge_id
        self.template = compile_rubric(rubric)
        self.rubric_digest = rubric_digest(rubric)
        self.scoring = scoring
        self.verdicts = dict(verdicts or {"yes": 1.0, "no": 0.0})
        self.score_range = score_range
        self.question_column = question_column
        self.cache_size = cache_size
        self.timeout_s = timeout_s  # the engine's bound on one call of score()
        self._cache: OrderedDict[str, JudgeReply] = OrderedDict()
        self.last_outputs: dict[int, str] = {}
        """Sample index -> the judge's text, for the samples of the last ``score`` call."""

    def cache_key(self, request: JudgeRequest) -> str:
        blob = json.dumps([self.judge_id, self.rubric_digest, self.scoring, request.text, request.image_digests])
        return hashlib.sha256(blob.encode()).hexdigest()

    def _question(self, batch: RewardBatch, i: int) -> str:
        if self.question_column:
            if self.question_column not in batch.extra:
                raise KeyError(f"question_column {self.question_column!r} is not a column of the batch "
                               f"(columns: {sorted(batch.extra) or 'none'})")
            return str(batch.extra[self.question_column][i])
        return question_from_prompt(batch.prompts[i])

    def _render(self, batch: RewardBatch) -> list[JudgeRequest | str]:
        """Each sample's request, or the error that it cannot be rendered (in a worker thread: see the module)."""
        parts = ImageParts()
        rendered: list[JudgeRequest | str] = []
        for i in range(len(batch)):
            try:
                rendered.append(render_request(self.template, question=self._question(batch, i),
                                               reference=batch.references[i], response=batch.responses[i],
                                               prompt=batch.prompts[i], escape=self.escape, parts=parts,
                                               images=list(batch.images[i]) if batch.images is not None else []))
            except Exception as exc:  # a template error names the variable; the sample is named here
                rendered.append(f"judge {self.name!r} on {batch.describe(i)}: cannot render the rubric: {exc}")
        return rendered

    async def score(self, batch: RewardBatch) -> SourceScores:
        n = len(batch)
        if n == 0:
            return SourceScores.empty(0)
        errors: list[str | None] = [None] * n
        replies: list[JudgeReply | None] = [None] * n
        keys: list[str | None] = [None] * n
        to_send: dict[str, list[int]] = {}
        requests: dict[str, JudgeRequest] = {}
        for i, request in enumerate(await asyncio.to_thread(self._render, batch)):
            if isinstance(request, str):
                errors[i] = request
                continue
            keys[i] = key = self.cache_key(request)
            if key in self._cache:
                self._cache.move_to_end(key)
                replies[i] = self._cache[key]
            else:
                to_send.setdefault(key, []).append(i)  # identical inputs within a batch are asked once
                requests[key] = request
        sent = list(to_send)
        answers = await self.backend.run([requests[k] for k in sent]) if sent else []
        fresh: set[int] = set()
        for key, answer in zip(sent, answers):
            for i in to_send[key]:
                if isinstance(answer, BaseException):
                    errors[i] = f"judge {self.name!r} on {batch.describe(i)}: {type(answer).__name__}: {answer}"
                else:
                    replies[i] = answer
                    fresh.add(i)
            if not isinstance(answer, BaseException) and self.cache_size > 0:
                self._cache[key] = answer
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return self._scores(batch, replies, errors, fresh)

    def _scores(self, batch: RewardBatch, replies: list[JudgeReply | None], errors: list[str | None],
                fresh: set[int]) -> SourceScores:
        n = len(batch)
        scores: list[float | None] = [None] * n
        parts: dict[str, list[float | None]] = {"latency_s": [None] * n, "queue_s": [None] * n,
                                                "cache_hit": [None] * n, "parse_failed": [None] * n}
        words = [w.lower() for w in self.verdicts] if self.scoring != "number" else []
        for word in words:
            parts[f"verdict_{word}"] = [None] * n
        self.last_outputs = {}
        for i, reply in enumerate(replies):
            if reply is None:
                continue
            assert batch.index is not None
            self.last_outputs[batch.index[i]] = reply.text
            parts["cache_hit"][i] = 0.0 if i in fresh else 1.0
            if i in fresh:
                parts["latency_s"][i], parts["queue_s"][i] = reply.latency_s, reply.queue_s
            try:
                scores[i], verdict = score_output(self.scoring, reply.text, reply.top_logprobs, self.verdicts,
                                                  self.score_range)
            except VerdictError as exc:
                parts["parse_failed"][i] = 1.0
                errors[i] = f"judge {self.name!r} on {batch.describe(i)}: {exc}"
                continue
            parts["parse_failed"][i] = 0.0
            for word in words:
                parts[f"verdict_{word}"][i] = 1.0 if verdict == word else 0.0
        texts = [None if reply is None else reply.text for reply in replies]
        return SourceScores(scores=scores, parts=parts, errors=errors, notes={"text": texts})
