"""What any Ray actor of a run needs, wherever it is created (the Ray launch mode's rollout and trainer actors, a
judge's own actor): starting or joining Ray, the actor's environment and threads, its options and GPUs, and Ray's
errors on one line. Below the launch layer so that a reward source can create its actor with the same rules."""

from __future__ import annotations

import math
import os
from typing import Any

# Read by vLLM, tokenizers and the data loaders at import time: the driver's values must reach the actors' processes
# (a worker on another node does not inherit the driver's environment).
FORWARDED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL",
                 "VLLM_CPU_OMP_THREADS_BIND", "FORCE_QWENVL_VIDEO_READER", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM",
                 "PYTHONPATH")
ENGINE_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the in-process engine: what the weight sync needs


def actor_env(cpus: float) -> dict[str, str]:
    """Environment of an actor reserving ``cpus`` CPUs: the forwarded variables plus thread counts sized to it."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    for k, v in ENGINE_DEFAULTS.items():
        env.setdefault(k, v)
    env["OMP_NUM_THREADS"] = str(actor_threads(cpus))
    return env


def actor_threads(cpus: float) -> int:
    """torch / OpenMP threads for an actor reserving ``cpus`` CPUs (at least one)."""
    return max(1, int(math.floor(cpus)))


def actor_options(name: str, cpus: float, gpus: float, *, max_restarts: int = 0, placement_group: Any = None,
                  bundle_index: int | None = None) -> dict[str, Any]:
    """``.options(...)`` of a named actor: its reservation, its runtime environment and, with a placement group,
    the bundle it runs in (its reservation is that bundle's)."""
    options: dict[str, Any] = {"name": name, "num_cpus": cpus, "num_gpus": gpus, "max_restarts": max_restarts,
                               "runtime_env": {"env_vars": actor_env(cpus)}}
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
    return options


def resolve_actor_gpus(value: float | None, key: str, auto: float, cluster_gpus: float) -> float:
    """An actor kind's GPUs: ``auto`` (None) on a GPU cluster, 0 on a CPU one; the value given otherwise, refused
    where it cannot work."""
    if value is None:
        return auto if cluster_gpus > 0 else 0.0
    if cluster_gpus > 0 and value == 0:
        raise ValueError(f"{key}=0 on a cluster with {cluster_gpus:g} GPUs: Ray would leave CUDA_VISIBLE_DEVICES "
                         f"unset and every actor would use GPU 0; leave {key} unset (auto: {auto:g}) or set it > 0")
    if cluster_gpus == 0 and value > 0:
        raise ValueError(f"{key}={value:g} but the Ray cluster has no GPUs (the actor would never be placed); "
                         f"leave {key} unset (auto: 0 here)")
    return float(value)


def connect(address: str | None, *, num_cpus: float) -> bool:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a local instance with ``num_cpus`` CPUs.
    Returns True when this call started Ray (the caller stops it at the end)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return True  # the connection is ours to close; the cluster stays up
    # "local": a new instance even where one is running on this machine (Ray would otherwise join the one its
    # `ray start` recorded, and refuse the CPU count given here)
    ray.init(address="local", num_cpus=max(1, math.ceil(num_cpus)), include_dashboard=False, log_to_driver=True)
    return True


def describe_actor_error(exc: BaseException) -> str:
    """Ray's error on one line (its class, the actor and why it died), bounded in length."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text if len(text) <= 600 else text[:600] + " ..."
