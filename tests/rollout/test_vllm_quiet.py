"""The notices dropped from vLLM's start-up are dropped by exact start, on their own logger, and nothing else is."""

from __future__ import annotations

import logging
import os
import warnings

from mmrlhf.rollout import vllm_quiet


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_known_notices_are_dropped_and_others_kept():
    vllm_quiet.install()
    vllm_quiet.install()  # idempotent: one filter per logger
    keep = _Keep()
    worker = logging.getLogger("vllm.v1.worker.cpu_worker")
    worker.addHandler(keep)
    level = worker.level
    worker.setLevel(logging.DEBUG)  # whatever VLLM_LOGGING_LEVEL the run has: the filter is what is tested
    try:
        assert sum(isinstance(f, vllm_quiet.DropKnown) for f in worker.filters) == 1
        worker.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
        worker.warning("%s is not found in LD_PRELOAD. For best performance ...", "libtcmalloc")
        worker.warning("Node 1 is not in available memory nodes [0].")  # not on the list: shows
        worker.warning("skip `torch.set_num_threads`: something new")  # same words, another message: shows
    finally:
        worker.removeHandler(keep)
        worker.setLevel(level)
    assert keep.messages == ["Node 1 is not in available memory nodes [0].",
                             "skip `torch.set_num_threads`: something new"]
    other = logging.getLogger("vllm.some.other.module")  # a listed message on another logger is not touched
    keep = _Keep()
    other.addHandler(keep)
    level = other.level
    other.setLevel(logging.DEBUG)
    try:
        other.warning("Enforce eager set, disabling torch.compile")
    finally:
        other.removeHandler(keep)
        other.setLevel(level)
    assert keep.messages == ["Enforce eager set, disabling torch.compile"]


def test_kernel_advice_is_dropped_only_for_a_model_trained_on_the_cpu():
    """transformers' "install causal-conv1d / flash-linear-attention" notices are advice on a GPU (they show) and
    noise on the CPU, where those CUDA kernels cannot be installed (the trainer drops them there)."""
    hub = logging.getLogger("transformers.integrations.hub_kernels")
    saved = list(hub.filters)
    for f in saved:
        hub.removeFilter(f)
    keep = _Keep()
    hub.addHandler(keep)
    advice = ("`causal_conv1d_fn` is falling back to its reference PyTorch implementation because `causal_conv1d` "
              "is not installed. This is correct but much slower; install `causal_conv1d` for the optimized kernel.")
    try:
        vllm_quiet.install()  # the engine's table alone: the advice still shows
        hub.warning(advice)
        vllm_quiet.install_cpu_training()
        vllm_quiet.install_cpu_training()
        assert sum(isinstance(f, vllm_quiet.DropKnown) for f in hub.filters) == 1
        hub.warning(advice)
        hub.warning("`some_new_kernel` is falling back to its reference PyTorch implementation")  # not listed
    finally:
        hub.removeHandler(keep)
        for f in list(hub.filters):
            hub.removeFilter(f)
        for f in saved:
            hub.addFilter(f)
    assert keep.messages == [advice, "`some_new_kernel` is falling back to its reference PyTorch implementation"]


def test_the_listed_future_warning_is_ignored_only_from_its_module():
    vllm_quiet.install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        vllm_quiet.install()  # catch_warnings reset the filters: install again inside
        warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated, please use ...", FutureWarning,
                               "dispatcher.py", 1, module="vllm.triton_utils.dispatcher")
        warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated, please use ...", FutureWarning,
                               "mine.py", 1, module="my_package.mine")
    assert [w.filename for w in caught] == ["mine.py"]


def test_filtered_stderr_drops_the_numa_line_and_forwards_the_rest(capfd):
    with vllm_quiet.filtered_stderr():
        os.write(2, b"[W1128 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation\n")
        os.write(2, b"Loading: 0%\rLoading: 100%\n")
        os.write(2, b"a real error from compiled code\nno newline at the end")
    os.write(2, b"\nafter\n")
    err = capfd.readouterr().err
    assert "NUMA" not in err
    assert err == "Loading: 0%\rLoading: 100%\na real error from compiled code\nno newline at the end\nafter\n"


def test_filtered_stderr_control_without_it_the_line_shows(capfd):
    os.write(2, b"Warning: NUMA binding: Using MEMBIND policy\n")
    assert "NUMA binding" in capfd.readouterr().err
