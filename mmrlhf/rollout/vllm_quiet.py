"""What importing and starting vLLM prints that a user cannot act on, dropped by exact message.

A run's terminal is part of the product: the progress bar and the lines a user must act on have to stay readable.
Importing vLLM and building its engine prints a dozen notices that say nothing to our users (deprecations inside
torch that vLLM triggers, "Triton has no CPU backend", "eager mode disables torch.compile" when we ask for eager,
NUMA binding by vLLM's CPU worker, ...), and one of them (the CPU worker's thread-count notice) repeats at every
request. Each is listed in :data:`KNOWN_NOISE` with why it is safe to drop; everything else those libraries say
still shows, so a new or changed message appears rather than vanishing. Matching is on the message's start (the
text before any variable part), on the named logger only.

vLLM's own INFO lines (its engine configuration dump, a "prefix cache reset" at every weight sync) are not
filtered here: :func:`mmrlhf.rollout.vllm_setup.configure_vllm_env` sets vLLM's level to WARNING unless the user
chose one (``VLLM_LOGGING_LEVEL``).

One notice does not go through Python at all: vLLM's CPU worker binds memory to a NUMA node in C++ and prints
``Warning: NUMA binding: ...`` straight to file descriptor 2. :func:`filtered_stderr` runs the CPU engine's
construction with fd 2 read through a pipe that forwards every other byte as it arrives.

``MMRLHF_ALL_NOTICES=1`` in the environment turns all of this off (to see everything while debugging an engine).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Iterator, Sequence

# (logger, start of the message, why it is safe to drop). The logger is the one the library logs to (its module).
KNOWN_NOISE: tuple[tuple[str, str, str], ...] = (
    ("torch._opaque_base", "torch._opaque_base is deprecated", "torch's deprecation, triggered inside vLLM"),
    ("torch._library.opaque_object", "register_opaque_type is deprecated", "torch's deprecation, inside vLLM"),
    ("torch._library.opaque_object", "typ='value' is deprecated", "torch's deprecation, inside vLLM"),
    ("torch._library.opaque_object", "typ='reference' is deprecated", "torch's deprecation, inside vLLM"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found", "a CPU machine has no CUDA runtime, by definition"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
     "the CPU engine runs without Triton (docs/environment.md)"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected", "same: no Triton on the CPU"),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32", "the CPU engine's linear-attention state dtype"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", "the CPU engine's V1 runner is the tested one"),
    ("vllm.config.vllm", "Enforce eager set", "eager mode is what the CPU engine is asked for"),
    ("vllm.config.vllm", "Inductor compilation was disabled", "same: eager mode, asked for"),
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill",
     "chunked prefill is off on the CPU on purpose (see make_llm); the engine-vs-trainer checks cover it"),
    ("vllm.engine.arg_utils", "The global random seed is set to",
     "the in-process engine seeds the process once at build; the trainer's own streams are seeded apart"),
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD",
     "allocator advice for serving throughput (docs/environment.md says how to preload)"),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`",
     "vLLM's CPU worker skips thread-count changes by design and says so twice per request"),
)

# Notices that only a model trained on the CPU may drop: (logger, start of the message, why). On an accelerator
# they are advice a user can act on, and they show there.
KNOWN_CPU_NOISE: tuple[tuple[str, str, str], ...] = (
    ("transformers.integrations.hub_kernels", "`causal_conv1d_fn` is falling back to its reference PyTorch",
     "causal-conv1d is a CUDA kernel: the CPU has no faster path to install (linear-attention families)"),
    ("transformers.integrations.hub_kernels", "`chunk_gated_delta_rule` is falling back to its reference PyTorch",
     "flash-linear-attention is a GPU (Triton) kernel: same, nothing to install on the CPU"),
)

# Lines written to file descriptor 2 by compiled code while the CPU engine is built (see the module docstring).
KNOWN_STDERR_NOISE: tuple[bytes, ...] = (b"Warning: NUMA binding: Using MEMBIND policy",)

# (message regex, category, module regex) for Python warnings raised inside a library at import.
KNOWN_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\.triton_utils\.dispatcher"),
)


class DropKnown(logging.Filter):
    """Drops a logger's records whose message template or text starts with one of ``starts``."""

    def __init__(self, starts: Sequence[str]) -> None:
        super().__init__()
        self.starts = tuple(starts)

    def filter(self, record: logging.LogRecord) -> bool:
        template = str(record.msg)
        return not (template.startswith(self.starts) or record.getMessage().startswith(self.starts))


def _all_notices() -> bool:
    return os.environ.get("MMRLHF_ALL_NOTICES", "") not in ("", "0")


def _attach(table: Sequence[tuple[str, str, str]]) -> None:
    by_logger: dict[str, list[str]] = {}
    for name, start, _why in table:
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        log = logging.getLogger(name)  # the same object the library's module gets later
        if not any(isinstance(f, DropKnown) and f.starts == tuple(starts) for f in log.filters):
            log.addFilter(DropKnown(starts))


def install() -> None:
    """Attach the filters (idempotent). Call before ``import vllm``: some notices are printed by the import."""
    if _all_notices():
        return
    _attach(KNOWN_NOISE)
    for message, category, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def install_cpu_training() -> None:
    """Drop :data:`KNOWN_CPU_NOISE` too (idempotent): the trainer calls it when its models live on the CPU."""
    if not _all_notices():
        _attach(KNOWN_CPU_NOISE)


def _forward(src: int, dst: int, drop: Sequence[bytes]) -> None:
    """Copy ``src`` to ``dst`` segment by segment (a segment ends at ``\\n`` or ``\\r``, so a progress bar's
    updates pass at once), leaving out segments that contain one of ``drop``; closes both at end of file."""
    pending = b""
    try:
        while True:
            chunk = os.read(src, 65536)
            if not chunk:
                break
            pending += chunk
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            ready, pending = pending[:cut], pending[cut:]
            out, start = bytearray(), 0
            for i, byte in enumerate(ready):
                if byte in (0x0A, 0x0D):
                    segment = ready[start:i + 1]
                    if not any(d in segment for d in drop):
                        out += segment
                    start = i + 1
            if out:
                os.write(dst, bytes(out))
        if pending and not any(d in pending for d in drop):
            os.write(dst, pending)
    finally:
        os.close(src)
        os.close(dst)


@contextmanager
def filtered_stderr(drop: Sequence[bytes] = KNOWN_STDERR_NOISE, *, drain_s: float = 2.0) -> Iterator[None]:
    """File descriptor 2 goes through a pipe for the duration; a thread forwards everything but the segments that
    contain one of ``drop`` to the real stderr. Afterwards fd 2 is the real stderr again; the thread ends when the
    pipe's last writer closes it (a subprocess started inside keeps its copy and stays forwarded: the thread is a
    daemon and owns its own duplicate of the real stderr). Without a usable fd 2 (an embedding that replaced
    ``sys.stderr``) nothing is redirected."""
    if _all_notices():
        yield
        return
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_forward, args=(read_end, os.dup(real), tuple(drop)),
                            name="mmrlhf-stderr-filter", daemon=True)
    pump.start()
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        finally:
            os.dup2(real, 2)  # the pipe's write end held as fd 2 is closed here: the pump sees end of file
            os.close(real)
            pump.join(drain_s)  # its output is written before the caller goes on (unless a subprocess holds it)
