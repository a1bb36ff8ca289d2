"""Where a judge runs, behind one interface: ``await backend.run(requests) -> list[JudgeReply | Exception]``.

- :class:`EndpointJudge`: any OpenAI-compatible chat-completions endpoint (``vllm serve``, a hosted API). One
  request per sample, at most ``max_concurrency`` in flight, each with a timeout and retries with backoff on the
  answers worth retrying (connection errors, timeouts, HTTP 408 / 429 / 502 / 503 / 504, as the remote source).
- :class:`VllmJudge`: an in-process ``vllm.LLM`` (built with :func:`mmrlhf.rollout.vllm_setup.make_llm`), one
  batched ``chat`` call per scoring call, in a thread so the event loop keeps serving other sources. With
  ``sleep: true`` the engine sleeps between calls (GPU only: its weights and KV cache leave the GPU, so it shares
  the policy's GPU); on the CPU make_llm drops sleep mode.
- :class:`~mmrlhf.rewards.judge.ray_actor.RayActorJudge` (its own module): a :class:`VllmJudge` inside a named Ray
  actor with its own resources, shared by every process of the run.

``chat_template_kwargs`` reach the judge's chat template on every path (the request body's field of that name for
a vLLM server, ``LLM.chat``'s argument in process): a judge that thinks by default (Qwen3.5) answers at once with
``{enable_thinking: false}``, which ``verdict_prob`` needs.

A request that fails for good comes back as its exception, so one bad sample fails alone (the source turns it into
that sample's error and the engine's failure policy decides).

Every reply says where its time went, the same way on every backend: ``latency_s`` is the judge's own time (from
the send to the answer: the HTTP requests actually sent, or the engine's generate), ``queue_s`` the time it waited
before that (for a free slot of ``max_concurrency``, or for the engine). They are apart because they answer
different questions: a slow judge shows in ``latency_s``; too little concurrency, or a client that cannot keep up,
in ``queue_s`` (a 256-sample batch at concurrency 8 waits 31 requests' time at the back of the queue).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from mmrlhf.rewards.judge.rubric import JudgeRequest
from mmrlhf.rewards.remote import RETRY_STATUSES, retry_after_seconds
from mmrlhf.rewards.types import RewardError


class JudgeCallError(RewardError):
    """A judge request failed for good."""


@dataclass
class JudgeReply:
    text: str
    """The judge's generated text."""
    top_logprobs: dict[str, float] | None
    """Top log-probs of the first generated token, by token text (None when not asked for)."""
    latency_s: float = 0.0
    """The judge's seconds on it: from the send to the answer (summed over an endpoint request's tries; the whole
    batched generate for a vLLM engine)."""
    queue_s: float = 0.0
    """Seconds it waited to be sent: for a free slot of ``max_concurrency`` (summed over tries; a retry's backoff
    is in neither), for the engine (another call's generate, its build, its wake-up), or on the Ray actor the whole
    round trip that is not the generate."""


@dataclass
class _Job:
    """One request on its way through :meth:`EndpointJudge.run`, and what it has cost so far."""

    index: int
    request: JudgeRequest
    queued_at: float = 0.0
    tries: int = 0
    queue_s: float = 0.0
    latency_s: float = 0.0
    problem: str = ""


class EndpointJudge:
    """An OpenAI-compatible ``/chat/completions`` endpoint; ``base_url`` ends before ``/chat/completions``.

    A call runs ``max_concurrency`` workers over one queue of requests and one HTTP client, so each worker keeps
    its connection alive for the whole call and nothing waits on a lock per request. A request to retry leaves its
    worker during its backoff and then queues again (a backing-off request never holds a slot). A body is made as
    it is sent, from parts serialised once per call (:meth:`encode_body`): only the bodies in flight are held,
    not a batch's worth of copies of its images.
    """

    def __init__(self, base_url: str, model: str, *, max_tokens: int, top_logprobs: int, api_key: str | None = None,
                 timeout_s: float = 60.0, max_retries: int = 4, backoff_s: float = 0.5, backoff_max_s: float = 8.0,
                 max_concurrency: int = 8, seed: int | None = None, transport: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_tokens = max_tokens
        self.top_logprobs = top_logprobs
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_concurrency = max_concurrency
        self._rng = random.Random(seed)
        self._transport = transport
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.requests_sent = 0
        self._head: bytes | None = None
        self._tls: Any = None  # httpx's TLS context, built once (reading the CA bundle costs ~20 ms per client)

    def body(self, request: JudgeRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": request.content}],
                                "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.top_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.chat_template_kwargs:  # a vLLM server's extension; other OpenAI-compatible servers may refuse it
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body

    def encode_body(self, request: JudgeRequest, fragments: dict[int, bytes] | None = None) -> bytes:
        """:meth:`body` as JSON bytes. ``fragments`` (content part id -> its JSON) lives for one call, so a part
        the samples of a group share (their prompt's image, a few hundred KB of base64) is serialised once, not
        once per sample; the fields around the message are serialised once per judge."""
        if self._head is None:
            head = self.body(JudgeRequest(content=[], text=""))
            del head["messages"]
            self._head = json.dumps(head)[:-1].encode()  # without its closing brace: the message follows
        fragments = {} if fragments is None else fragments
        parts = []
        for part in request.content:
            fragment = fragments.get(id(part))
            if fragment is None:
                fragment = fragments[id(part)] = json.dumps(part).encode()
            parts.append(fragment)
        return self._head + b', "messages": [{"role": "user", "content": [' + b", ".join(parts) + b"]}]}"

    async def run(self, requests: list[JudgeRequest]) -> list[JudgeReply | Exception]:
        import httpx

        if not requests:
            return []
        fragments: dict[int, bytes] = {}  # the requests hold their parts for the whole call: ids stay unique
        jobs = [_Job(i, r) for i, r in enumerate(requests)]
        results: list[JudgeReply | Exception | None] = [None] * len(jobs)
        queue: asyncio.Queue[_Job | None] = asyncio.Queue()
        workers = min(self.max_concurrency, len(jobs))
        left = len(jobs)
        backoffs: set[asyncio.Task] = set()

        def enqueue(job: _Job) -> None:
            job.queued_at = time.monotonic()
            queue.put_nowait(job)

        async def after_backoff(job: _Job, delay: float) -> None:
            await asyncio.sleep(delay)
            enqueue(job)

        async def worker(client: Any) -> None:
            nonlocal left
            while (job := await queue.get()) is not None:
                job.queue_s += time.monotonic() - job.queued_at
                try:
                    outcome = await self._attempt(client, job, fragments)
                except Exception as exc:  # noqa: BLE001 - anything unforeseen fails this request alone
                    outcome = exc
                if isinstance(outcome, float):
                    task = asyncio.ensure_future(after_backoff(job, outcome))
                    backoffs.add(task)
                    task.add_done_callback(backoffs.discard)
                    continue
                if isinstance(outcome, JudgeReply):
                    outcome.latency_s, outcome.queue_s = job.latency_s, job.queue_s
                results[job.index] = outcome
                left -= 1
                if left == 0:  # every request answered or failed for good: the workers stop
                    for _ in range(workers):
                        queue.put_nowait(None)

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
        if self._tls is None and self._transport is None:
            self._tls = httpx.create_ssl_context()
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers, limits=limits,
                                     transport=self._transport, verify=self._tls or True) as client:
            for job in jobs:  # queued once the client is there: its set-up is nobody's queueing
                enqueue(job)
            try:
                await asyncio.gather(*(worker(client) for _ in range(workers)))
            finally:
                for task in list(backoffs):
                    task.cancel()
        assert all(r is not None for r in results), "a judge request was neither answered nor failed"
        return results  # type: ignore[return-value]

    async def _attempt(self, client: Any, job: _Job, fragments: dict[int, bytes]) -> JudgeReply | Exception | float:
        """One try of ``job``: its reply, its final error, or the seconds to wait before trying again."""
        import httpx

        self.requests_sent += 1
        job.tries += 1
        asked = None
        body = self.encode_body(job.request, fragments)
        sent = time.monotonic()
        try:
            response = await client.post(self.url, content=body)
        except httpx.TransportError as exc:
            job.latency_s += time.monotonic() - sent
            job.problem = f"{type(exc).__name__}: {exc or 'no detail'}"
        else:
            job.latency_s += time.monotonic() - sent
            if response.status_code == 200:
                return parse_chat_completion(response.json(), self.url)
            job.problem = f"HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code not in RETRY_STATUSES:
                return JudgeCallError(f"judge endpoint {self.url} refused the request: {job.problem}")
            asked = retry_after_seconds(response.headers.get("retry-after"))
        if job.tries > self.max_retries:
            return JudgeCallError(f"judge endpoint {self.url} failed after {job.tries} attempts: {job.problem}")
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (job.tries - 1))
        return float(max(delay / 2 + self._rng.uniform(0, delay / 2), asked or 0.0))


def parse_chat_completion(answer: dict[str, Any], url: str) -> JudgeReply:
    """The reply in an OpenAI chat-completions answer (text, and the first token's top log-probs if sent)."""
    try:
        choice = answer["choices"][0]
        text = choice["message"]["content"] or ""
        tokens = ((choice.get("logprobs") or {}).get("content")) or []
    except (KeyError, IndexError, TypeError) as exc:
        raise JudgeCallError(f"judge endpoint {url} sent a malformed answer ({exc!r}): {str(answer)[:300]}") from None
    top = None
    if tokens:
        top = {}
        for entry in tokens[0].get("top_logprobs") or [{"token": tokens[0]["token"], "logprob": tokens[0]["logprob"]}]:
            top[entry["token"]] = max(top.get(entry["token"], float("-inf")), float(entry["logprob"]))
    return JudgeReply(text=text, top_logprobs=top)


class VllmJudge:
    """An in-process vLLM engine for the judge model at ``path`` (built on first use, then kept)."""

    def __init__(self, path: str, *, max_tokens: int, top_logprobs: int, sleep: bool = False,
                 engine_options: dict[str, Any] | None = None, llm: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        """``llm``: an already built engine (tests, or an engine the caller shares)."""
        self.path = path
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_tokens = max_tokens
        self.top_logprobs = top_logprobs
        self.sleep = sleep
        self.engine_options = dict(engine_options or {})
        self._llm = llm
        self._lock = asyncio.Lock()

    def _engine(self) -> Any:
        if self._llm is None:
            from mmrlhf.rollout.vllm_setup import make_llm

            options = dict(self.engine_options)
            if self.sleep:
                options.setdefault("enable_sleep_mode", True)
            self._llm = make_llm(self.path, **options)
            if self.sleep and hasattr(self._llm, "sleep") and _sleeps(self._llm):
                self._llm.sleep(level=1)
        return self._llm

    async def run(self, requests: list[JudgeRequest]) -> list[JudgeReply | Exception]:
        arrived = time.monotonic()
        async with self._lock:  # one generate at a time: the engine is not re-entrant
            return await asyncio.to_thread(self._run_sync, requests, arrived)

    def _run_sync(self, requests: list[JudgeRequest], arrived: float) -> list[JudgeReply | Exception]:
        """The batched generate; its time is every reply's ``latency_s``, and the wait before it (the lock, the
        engine's build on first use, its wake-up) their ``queue_s``."""
        from vllm import SamplingParams

        from mmrlhf.rollout.vllm_setup import settle_cpu_threads

        settle_cpu_threads()  # this call's thread is whichever the event loop's executor gave
        llm = self._engine()
        sleeps = self.sleep and _sleeps(llm)
        if sleeps:
            llm.wake_up()
        try:
            params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                    logprobs=self.top_logprobs or None)
            start = time.monotonic()
            outputs = llm.chat([[{"role": "user", "content": r.content}] for r in requests], params,
                               use_tqdm=False, chat_template_kwargs=self.chat_template_kwargs or None)
            latency = time.monotonic() - start
        finally:
            if sleeps:
                llm.sleep(level=1)
        replies = [_reply(out) for out in outputs]
        for reply in replies:
            reply.latency_s, reply.queue_s = latency, start - arrived
        return replies


def _sleeps(llm: Any) -> bool:
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return bool(getattr(getattr(config, "model_config", None), "enable_sleep_mode", False))


def _reply(output: Any) -> JudgeReply:
    completion = output.outputs[0]
    top = None
    if completion.logprobs:
        top = {}
        for entry in completion.logprobs[0].values():
            token = entry.decoded_token or ""
            top[token] = max(top.get(token, float("-inf")), float(entry.logprob))
    return JudgeReply(text=completion.text, top_logprobs=top)

