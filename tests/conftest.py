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
# The suite never reads the machine's own record of what `mmrlhf doctor --gpu` proved (mmrlhf.proofs): on a GPU
# machine where the doctor ran, `auto` defaults would otherwise change under the tests that pin them.
import tempfile  # noqa: E402

os.environ["MMRLHF_PROOFS"] = os.path.join(tempfile.mkdtemp(prefix="mmrlhf-proofs-"), "gpu_proofs.json")

# Each pytest-xdist worker gets its share of the cores for OpenMP (torch's and vLLM's CPU kernels), and so do the
# processes it starts (mmrlhf.testing.suite_order.worker_threads says why). OpenMP reads it once, when torch loads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    assert "torch" not in sys.modules, "torch was imported before tests/conftest.py could size its OpenMP threads"
    from mmrlhf.testing.suite_order import worker_threads

    os.environ["OMP_NUM_THREADS"] = str(worker_threads(len(os.sched_getaffinity(0)),
                                                       int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # A run that collects nothing is a broken run (wrong path, import-time skip, bad marker expression), never a
    # pass: stop with a usage error rather than pytest's "no tests ran".
    if not items:
        raise pytest.UsageError("no tests were collected: check the paths and the -m / -k expressions")
    from mmrlhf.testing.suite_order import longest_files_first

    items[:] = longest_files_first(items, _file_seconds())


# Measured seconds per test file (scripts/test_durations.py writes it): the longest files go to the workers first
# (mmrlhf.testing.suite_order).
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")


def _file_seconds() -> dict[str, float]:
    import json

    try:
        with open(DURATIONS) as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


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
