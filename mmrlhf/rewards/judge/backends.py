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
"""

from __future__ import annotations

import asyncio
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
    """Seconds this reply took (an endpoint request, retries included; the whole batch for the vLLM engine)."""


class EndpointJudge:
    """An OpenAI-compatible ``/chat/completions`` endpoint; ``base_url`` ends before ``/chat/completions``."""

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

    def body(self, request: JudgeRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": request.content}],
                                "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.top_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.chat_template_kwargs:  # a vLLM server's extension; other OpenAI-compatible servers may refuse it
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body

    async def run(self, requests: list[JudgeRequest]) -> list[JudgeReply | Exception]:
        import httpx

        semaphore = asyncio.Semaphore(self.max_concurrency)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers, limits=limits,
                                     transport=self._transport) as client:
            return list(await asyncio.gather(*(self._one(client, semaphore, r) for r in requests),
                                             return_exceptions=True))

    async def _one(self, client, semaphore: asyncio.Semaphore, request: JudgeRequest) -> JudgeReply:
        import httpx

        body = self.body(request)
        start = time.monotonic()
        problem = ""
        for attempt in range(self.max_retries + 1):
            asked = None
            async with semaphore:
                self.requests_sent += 1
                try:
                    response = await client.post(self.url, json=body)
                except httpx.TransportError as exc:
                    problem = f"{type(exc).__name__}: {exc or 'no detail'}"
                else:
                    if response.status_code == 200:
                        reply = parse_chat_completion(response.json(), self.url)
                        reply.latency_s = time.monotonic() - start
                        return reply
                    problem = f"HTTP {response.status_code}: {response.text[:300]}"
                    if response.status_code not in RETRY_STATUSES:
                        raise JudgeCallError(f"judge endpoint {self.url} refused the request: {problem}")
                    asked = retry_after_seconds(response.headers.get("retry-after"))
            if attempt < self.max_retries:
                delay = min(self.backoff_max_s, self.backoff_s * 2**attempt)
                await asyncio.sleep(max(delay / 2 + self._rng.uniform(0, delay / 2), asked or 0.0))
        raise JudgeCallError(f"judge endpoint {self.url} failed after {self.max_retries + 1} attempts: {problem}")


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
        async with self._lock:  # one generate at a time: the engine is not re-entrant
            return await asyncio.to_thread(self._run_sync, requests)

    def _run_sync(self, requests: list[JudgeRequest]) -> list[JudgeReply | Exception]:
        from vllm import SamplingParams

        llm = self._engine()
        start = time.monotonic()
        sleeps = self.sleep and _sleeps(llm)
        if sleeps:
            llm.wake_up()
        try:
            params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                    logprobs=self.top_logprobs or None)
            outputs = llm.chat([[{"role": "user", "content": r.content}] for r in requests], params,
                               use_tqdm=False, chat_template_kwargs=self.chat_template_kwargs or None)
        finally:
            if sleeps:
                llm.sleep(level=1)
        replies = [_reply(out) for out in outputs]
        for reply in replies:
            reply.latency_s = time.monotonic() - start
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

