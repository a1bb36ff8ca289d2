"""Starting or joining Ray, and what every actor's process needs (environment, threads, resources)."""

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


def actor_options(name: str, cpus: float, gpus: float, *, max_restarts: int = 0) -> dict[str, Any]:
    """``.options(...)`` of a named actor: its reservation and its runtime environment."""
    return {"name": name, "num_cpus": cpus, "num_gpus": gpus, "max_restarts": max_restarts,
            "runtime_env": {"env_vars": actor_env(cpus)}}


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
    ray.init(num_cpus=max(1, math.ceil(num_cpus)), include_dashboard=False, log_to_driver=True)
    return True


def describe_actor_error(exc: BaseException) -> str:
    """Ray's error on one line (its class, the actor and why it died), bounded in length."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text if len(text) <= 600 else text[:600] + " ..."
