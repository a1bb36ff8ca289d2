"""Suite-wide fixtures and guards."""

from __future__ import annotations

import gc
import os
import sys

import pytest

# vLLM on the CPU: in-process engine and a small KV cache (scripts/env.sh sets these too; direct pytest runs
# need them before vllm is imported).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The files that take longest (minutes each: learning runs, several launch modes, Ray), longest first. They are
# collected first, so two xdist workers dealing whole files in collection order (scripts/test.sh: --dist loadfile
# --no-loadscope-reorder) start them at once and finish the suite on the short files, instead of one worker
# running a learning test alone at the end. Re-rank from a run's `--durations` when the suite changes.
HEAVY_FIRST = (
    "tests/agents/test_agent_toy.py",
    "tests/launch/test_ray_training.py",
    "tests/launch/test_one_loop.py",
    "tests/launch/test_torchrun.py",
    "tests/agents/test_agent_launch_modes.py",
    "tests/launch/test_ray_partial.py",
    "tests/trainer/test_trainer_vllm.py",
    "tests/test_console_output.py",
    "tests/test_engine_vllm.py",
)


def heavy_first(items: list) -> list:
    """``items`` with the tests of :data:`HEAVY_FIRST` in front, in that order; every other test keeps its place."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, int]:
        index, item = indexed
        return (rank.get(item.nodeid.split("::", 1)[0], len(rank)), index)

    return [item for _, item in sorted(enumerate(items), key=key)]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # A run that collects nothing is a broken run (wrong path, import-time skip, bad marker expression), never a
    # pass: stop with a usage error rather than pytest's "no tests ran".
    if not items:
        raise pytest.UsageError("no tests were collected: check the paths and the -m / -k expressions")
    items[:] = heavy_first(items)


@pytest.fixture(scope="session")
def tiny_qwen2_vl():
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return tiny_model_dir("qwen2_vl", "tiny", 0)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl():
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return tiny_model_dir("qwen2_5_vl", "tiny", 0)


_FAILED = pytest.StashKey[bool]()  # set on a test whose call failed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if call.when == "call" and outcome.get_result().failed:
        item.stash[_FAILED] = True


@pytest.fixture(autouse=True)
def _collect_a_failed_tests_engines(request: pytest.FixtureRequest):
    """A failed test's traceback keeps its objects alive, an in-process vLLM engine among them; collected later, in
    the middle of another test, that engine's shutdown tears down vLLM's process-wide parallel groups under the
    other test's live engine ("pipeline model parallel group is not initialized"): one failure would be reported
    as two. Collect them when the failure is reported, while no other engine runs."""
    yield
    if request.node.stash.get(_FAILED, False) and "vllm" in sys.modules:
        sys.last_traceback = sys.last_value = sys.last_type = None
        gc.collect()
