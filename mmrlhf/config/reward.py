"""``reward``: reward sources and per-label recipes.

``label_map`` names the reward sources (rule/user functions, local reward models, remote reward servers);
``recipe`` says, per sample label, which sources score that sample and with what weight. A source only ever sees
the samples whose recipe gives it a non-zero weight. See docs/rewards.md for the full story and a YAML example.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from mmrlhf.config.base import Section


class FunctionSourceConfig(Section):
    type: Literal["function"]
    """A Python reward function (rule rewards, user plugins)."""
    function: str = Field(min_length=1)
    """Built-in name (``think_answer_format``, ``math_accuracy``, ...) or ``package.module:fn`` / ``file.py:fn``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to every call (e.g. ``{rel_tol: 0.01}`` for ``numeric_match``)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Bound on one call over a rollout's samples: past it the call's samples fail (``reward.on_failure``: an error
    naming the source, or masked and counted) and the stuck thread is replaced in the pool (a thread cannot be
    killed: its late result is dropped). Functions marked to run on the main thread (``math_accuracy``) are bounded
    by their own alarm instead."""


class ModelSourceConfig(Section):
    type: Literal["model"]
    """A torch reward model scoring token sequences (+ vision inputs) in this process."""
    model: str = Field(min_length=1)
    """Reward-model kind: ``qwen_vl_scalar`` (Qwen-VL backbone + scalar head) or ``package.module:factory``."""
    path: str = ""
    """Checkpoint directory handed to the kind's builder (required by ``qwen_vl_scalar``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the builder."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype the model is loaded in."""
    device: str = "auto"
    """Device the model runs on while scoring (``auto``: the accelerator torch finds, else ``cpu``)."""
    offload_device: str = "cpu"
    """Where the model waits between calls, so it holds no accelerator memory during rollout and training."""
    micro_batch_size: int = Field(default=8, ge=1)
    """Samples per forward pass (bounds activation memory)."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Bound on scoring one rollout's samples: past it they fail (``reward.on_failure``)."""


class RemoteSourceConfig(Section):
    type: Literal["remote"]
    """A reward server reached over HTTP (``mmrlhf serve-reward`` or any server speaking its protocol)."""
    url: str = Field(min_length=1)
    """Full URL of the scoring endpoint, e.g. ``http://127.0.0.1:8000/score``."""
    token_file: str = ""
    """File holding the bearer token sent to the server (empty: no token)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Per-request timeout (connect + read); keep it above the server's ``--request-timeout-s``."""
    max_retries: int = Field(default=8, ge=0)
    """Most retries of one request. Only connection errors, timeouts and HTTP 408 / 429 / 502 / 503 / 504 are
    retried; other answers (4xx, 500) would repeat and fail the batch at once."""
    backoff_s: float = Field(default=0.5, ge=0)
    """First retry delay; doubles each retry (with jitter). A ``Retry-After`` header asking for longer wins."""
    backoff_max_s: float = Field(default=8.0, ge=0)
    """Upper bound of one retry delay. With the defaults a request keeps retrying for 20 to 40 s, which rides out a
    server restart (3 to 8 s for ``serve-reward``)."""
    retry_window_s: float = Field(default=60.0, ge=0)
    """Retry budget shared by all requests of one batch: once this many seconds have passed since the batch's
    first failed request, nothing more is retried and the batch fails (bounds the time lost to an outage)."""
    batch_size: int = Field(default=32, ge=1)
    """Samples per request."""
    max_concurrency: int = Field(default=8, ge=1)
    """Requests in flight at once."""
    send_images: bool = True
    """Send the samples' raw images (base64 PNG) along with the text."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {value!r}")
        return value


class JudgeSourceConfig(Section):
    type: Literal["judge"]
    """A vision-language model judging each answer through a rubric (docs/rewards.md, "Judge")."""
    backend: Literal["endpoint", "vllm", "ray"] = "endpoint"
    """``endpoint``: an OpenAI-compatible server (``vllm serve``, a hosted API) at ``url``; ``vllm``: an in-process
    vLLM engine loading the checkpoint ``model`` (beside the policy's engine; ``sleep`` shares its GPU); ``ray``: that
    engine in a named Ray actor of its own (``actor_cpus`` / ``actor_gpus``), created once per run and shared by every
    rollout actor (with ``distributed.backend=ray`` the driver creates it; in one process the first call does,
    joining ``RAY_ADDRESS`` or starting a local Ray)."""
    model: str = Field(min_length=1)
    """The judge: the served model name (``endpoint``) or a checkpoint directory (``vllm``, ``ray``)."""
    url: str = ""
    """Base URL of the endpoint, up to and including ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``); ``endpoint`` only."""
    api_key_file: str = ""
    """File holding the API key sent as a bearer token (empty: none)."""
    rubric: str = ""
    """Jinja template of the judge's message, inline or a ``.j2`` / ``.jinja`` / ``.txt`` file path (empty: the
    built-in yes / no rubric). Variables: ``question``, ``reference`` (None if the sample has none), ``answer`` (the
    final answer, thinking stripped), ``images`` (markers placing each image)."""
    scoring: Literal["verdict", "number", "verdict_prob"] = "verdict_prob"
    """``verdict``: the first verdict word of the judge's text; ``number``: the last number, in ``score_range``,
    scaled to [0, 1]; ``verdict_prob``: the verdict-weighted probability of the first generated token (no parsing,
    no sampling noise; with the default verdicts p(yes) / (p(yes) + p(no)))."""
    verdicts: dict[str, float] = Field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    """Verdict word -> score (``verdict`` and ``verdict_prob``); case-blind; for ``verdict_prob`` each must be one
    token of the judge's tokenizer (with or without a leading space)."""
    score_range: tuple[float, float] = (0.0, 10.0)
    """``[lo, hi]`` of the number the rubric asks for (``number``)."""
    question_column: str = ""
    """Dataset column holding the question text (empty: the last user turn of the prompt, vision blocks removed)."""
    max_tokens: int = Field(default=16, ge=1)
    """Most tokens the judge generates (``verdict_prob`` reads only the first)."""
    top_logprobs: int = Field(default=20, ge=0, le=20)
    """Top log-probs asked for the first token (``verdict_prob`` needs >= 1; vLLM serves at most 20 by default)."""
    max_concurrency: int = Field(default=8, ge=1)
    """Endpoint requests in flight at once (one request per sample)."""
    request_timeout_s: float = Field(default=60.0, gt=0)
    """Timeout of one endpoint request."""
    max_retries: int = Field(default=4, ge=0)
    """Retries of one endpoint request (connection errors, timeouts, HTTP 408 / 429 / 502 / 503 / 504)."""
    backoff_s: float = Field(default=0.5, ge=0)
    """First retry delay; doubles each retry, with jitter, up to ``backoff_max_s``."""
    backoff_max_s: float = Field(default=8.0, ge=0)
    """Upper bound of one retry delay."""
    cache_size: int = Field(default=4096, ge=0)
    """Replies kept, keyed by (judge, rubric, scoring, rendered text, images); 0 turns the cache off."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Bound on judging one rollout's samples: past it they fail (``reward.on_failure``)."""
    sleep: bool = False
    """``vllm`` on a GPU: the engine sleeps between calls (weights and KV cache off the GPU) so it can share the
    policy's GPU; ignored on the CPU."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """``vllm`` and ``ray``: settings for ``make_llm`` (``dtype``, ``max_model_len``, ``gpu_memory_utilization``,
    ``tensor_parallel_size``, ...)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Variables for the judge's chat template, on every backend (a vLLM server takes them in the request body;
    other OpenAI-compatible servers may refuse the field). A judge that thinks by default needs
    ``{enable_thinking: false}`` for ``verdict_prob`` (its first token would open the thinking block)."""
    actor_cpus: float = Field(default=1.0, gt=0)
    """``ray``: CPUs the judge's actor reserves (and its torch threads)."""
    actor_gpus: float | None = Field(default=None, ge=0)
    """``ray``: GPUs the judge's actor reserves; unset: ``engine.tensor_parallel_size`` (1) on a GPU cluster, 0 on
    a CPU one. They are the judge's own: not taken from the rollout or trainer actors' placement group."""

    @field_validator("verdicts", mode="before")
    @classmethod
    def _word_keys(cls, value: Any) -> Any:
        # YAML 1.1 reads unquoted yes / no / on / off as booleans: {yes: 1.0, no: 0.0} arrives as {True: 1.0, ...}.
        if isinstance(value, dict) and any(isinstance(k, bool) for k in value):
            raise ValueError("verdict words must be strings, got booleans: YAML reads unquoted yes / no / on / off "
                             "as true / false; quote them: {\"yes\": 1.0, \"no\": 0.0}")
        return value

    @model_validator(mode="after")
    def _check(self) -> "JudgeSourceConfig":
        if self.backend == "endpoint" and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend 'endpoint' needs url starting with http:// or https://, got {self.url!r}")
        if self.scoring != "number" and not self.verdicts:
            raise ValueError(f"scoring {self.scoring!r} needs at least one entry in verdicts")
        if self.sleep and self.backend != "vllm":
            raise ValueError(f"sleep: true is for backend 'vllm' (an engine beside the policy's); backend "
                             f"{self.backend!r} has no engine to put to sleep here")
        if self.scoring == "verdict_prob" and self.top_logprobs < 1:
            raise ValueError("scoring 'verdict_prob' needs top_logprobs >= 1")
        lo, hi = self.score_range
        if not lo < hi:
            raise ValueError(f"score_range must be [lo, hi] with lo < hi, got [{lo}, {hi}]")
        return self


SourceConfig = Annotated[
    Union[FunctionSourceConfig, ModelSourceConfig, RemoteSourceConfig, JudgeSourceConfig], Field(discriminator="type")
]
RecipeEntry = tuple[str, float]


class RewardConfig(Section):
    label_map: dict[str, SourceConfig] = Field(default_factory=dict)
    """Reward sources by name. A bare string is shorthand for ``{type: function, function: <string>}``."""
    recipe: dict[str, list[RecipeEntry]] = Field(default_factory=dict)
    """Sample label -> list of ``[source, weight]``; the reward is the weighted sum of the sources that apply."""
    default_recipe: list[RecipeEntry] | None = None
    """Recipe for labels missing from ``recipe`` (None: such a label is an error naming it)."""
    on_failure: Literal["error", "mask"] = "error"
    """A source failing on a sample (raises, NaN, wrong count): ``error`` stops naming source and sample;
    ``mask`` drops the sample from the loss and counts it in the metrics."""
    function_workers: int = Field(default=4, ge=1)
    """Threads running synchronous reward functions (one pool shared by all function sources), so a slow rule
    computes while remote requests and other sources proceed. ``async def`` functions run on the event loop."""

    @field_validator("label_map", mode="before")
    @classmethod
    def _expand_shorthand(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"type": "function", "function": v} if isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _check_recipes(self) -> "RewardConfig":
        recipes = dict(self.recipe)
        if self.default_recipe is not None:
            recipes["<default_recipe>"] = self.default_recipe
        for label, entries in recipes.items():
            seen: set[str] = set()
            for source, weight in entries:
                if source not in self.label_map:
                    valid = ", ".join(sorted(self.label_map)) or "(none defined)"
                    raise ValueError(
                        f"recipe {label!r} uses reward source {source!r}, which label_map does not define; "
                        f"defined sources: {valid}"
                    )
                if source in seen:
                    raise ValueError(f"recipe {label!r} lists reward source {source!r} twice")
                if not math.isfinite(weight):
                    raise ValueError(f"recipe {label!r}: weight of {source!r} must be finite, got {weight}")
                seen.add(source)
            if entries and all(weight == 0.0 for _, weight in entries):
                raise ValueError(
                    f"recipe {label!r} gives every source a weight of 0: a weight of 0 means the source is not run, "
                    "so every sample of that label would be masked out of the loss; give a source a non-zero "
                    "weight (or write an empty recipe [] to mask that label on purpose)"
                )
        return self
