"""How each process builds its vLLM engine, without a GPU: the engine arguments of torchrun ranks on a CUDA world
(vLLM's external-launcher executor, one engine per rank), the device each rank re-asserts after the build (a fake
accelerator whose current device the engine build moves, as vLLM's default executor does) and the tested vLLM version
range. Tensor-parallel engines over torchrun ranks: tests/rollout/test_tensor_parallel_engine.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from mmrlhf.rollout import vllm_setup
from mmrlhf.rollout.vllm_setup import LaunchRanks, engine_device, engine_kwargs

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def _ranks(rank: int) -> LaunchRanks:
    return LaunchRanks(rank=rank, local_rank=rank, world_size=WORLD)


@pytest.mark.parametrize("rank", [0, 1])
def test_torchrun_ranks_on_cuda_use_the_external_launcher_and_their_own_device(rank):
    kwargs = engine_kwargs("/m", device_type="cuda", ranks=_ranks(rank), seed=5, tensor_parallel_size=1)
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["seed"] == 5 and kwargs["dtype"] == "bfloat16"
    assert engine_device("cuda", _ranks(rank)) == torch.device("cuda", rank)


def test_outside_torchrun_and_on_the_cpu_nothing_is_bound():
    """Controls: one process keeps vLLM's in-process executor (TP 1) or its multiprocess one (TP > 1, also inside a
    Ray actor's placement group); the CPU keeps the in-process default under torchrun too."""
    single = engine_kwargs("/m", device_type="cuda", ranks=None)
    assert "distributed_executor_backend" not in single and engine_device("cuda", None) is None
    tp = engine_kwargs("/m", device_type="cuda", ranks=None, tensor_parallel_size=2)
    assert tp["distributed_executor_backend"] == "mp" and tp["tensor_parallel_size"] == 2
    cpu = engine_kwargs("/m", device_type="cpu", ranks=_ranks(1), tensor_parallel_size=1)
    assert "distributed_executor_backend" not in cpu and "tensor_parallel_size" not in cpu
    assert cpu["enable_chunked_prefill"] is False and engine_device("cpu", _ranks(1)) is None


class _FakeAccelerator:
    """torch.accelerator's current-device calls, without a device."""

    def __init__(self, index: int) -> None:
        self.index = index

    def set_device_index(self, index) -> None:
        self.index = index.index if isinstance(index, torch.device) else int(index)

    def current_device_index(self) -> int:
        return self.index


@pytest.mark.parametrize("rank", [0, 1])
def test_make_llm_reasserts_the_ranks_device_after_the_engine_build(monkeypatch, rank):
    """Rank ``rank`` of a 2-rank CUDA world set its device (init_from_env); the engine build moves the current
    device to 0 (what vLLM's default in-process executor does on every rank); after make_llm the rank's device is
    current again and the engine was asked for the external launcher."""
    import vllm

    fake = _FakeAccelerator(rank)
    seen = {}

    def build(**kwargs):
        seen.update(kwargs)
        fake.set_device_index(0)
        return "llm"

    monkeypatch.setattr(torch.accelerator, "set_device_index", fake.set_device_index)
    monkeypatch.setattr(torch.accelerator, "current_device_index", fake.current_device_index)
    monkeypatch.setattr(vllm, "LLM", build)
    monkeypatch.setattr(vllm_setup, "platform_device_type", lambda: "cuda")
    monkeypatch.setattr(vllm_setup, "launch_ranks", lambda: _ranks(rank))
    monkeypatch.setattr(vllm_setup, "processors_normalise_alike", lambda *a, **k: True)
    assert vllm_setup.make_llm("/m") == "llm"
    assert fake.index == rank
    assert seen["distributed_executor_backend"] == "external_launcher"


def test_launch_ranks_need_torchrun_and_a_joined_group(monkeypatch):
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert vllm_setup.launch_ranks({}) is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert vllm_setup.launch_ranks(env) is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert vllm_setup.launch_ranks(env) == LaunchRanks(1, 1, 2)


# ---- the vLLM version range -----------------------------------------------------------------------------------
@pytest.fixture()
def fresh_warnings(monkeypatch, caplog):
    """A process that has warned of no vLLM version yet; yields the warnings ``check_vllm_version`` logs."""
    import logging

    monkeypatch.setattr(vllm_setup, "_warned_versions", set(), raising=False)
    with caplog.at_level(logging.WARNING, logger="mmrlhf.rollout.vllm_setup"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "mmrlhf.rollout.vllm_setup"]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1.dev12+cpu", "0.33.0", "0.33.2"])
def test_tested_versions_pass_silently(version, fresh_warnings):
    assert vllm_setup.check_vllm_version(version) is True
    assert fresh_warnings() == []


@pytest.mark.parametrize("version", ["0.31.2", "0.20.0", "0.31.99.dev3"])
def test_an_older_vllm_is_refused_naming_the_lowest_tested_release(version, monkeypatch):
    monkeypatch.setenv("MMRLHF_ALLOW_UNTESTED_VLLM", "1")  # the old override is gone: nothing lets it through
    with pytest.raises(vllm_setup.VLLMVersionError,
                       match=rf"vLLM {version} is older than the oldest release .* tested with \(0\.32; tested: "
                             r"vllm>=0\.32,<0\.34\).*pip install 'vllm>=0\.32,<0\.34'"):
        vllm_setup.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.34.0", "1.0.0", "not-a-version"])
def test_a_newer_vllm_runs_with_one_warning_naming_the_range_and_the_doctor(version, fresh_warnings):
    assert vllm_setup.check_vllm_version(version) is False
    assert vllm_setup.check_vllm_version(version) is False  # every engine build asks; one warning per process
    [warning] = fresh_warnings()
    assert f"vLLM {version} is newer than" in warning and "vllm>=0.32,<0.34" in warning and "mmrlhf doctor" in warning


def test_the_engine_build_refuses_an_older_vllm_and_builds_with_a_newer_one(monkeypatch, fresh_warnings,
                                                                            tiny_qwen2_vl):
    import vllm

    built = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: built.append(kw) or "engine")
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    with pytest.raises(vllm_setup.VLLMVersionError, match="0.31.1"):
        vllm_setup.make_llm(str(tiny_qwen2_vl))
    assert built == []
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    assert vllm_setup.make_llm(str(tiny_qwen2_vl)) == "engine"
    assert [kw["model"] for kw in built] == [str(tiny_qwen2_vl)]
    assert len(fresh_warnings()) == 1 and "0.35.0" in fresh_warnings()[0]


def test_installed_vllm_is_in_range_and_the_gpu_extra_pins_the_same_range():
    import vllm

    assert vllm_setup.check_vllm_version(vllm.__version__) is True
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    low, high = vllm_setup.VLLM_TESTED_RANGE
    assert extras["vllm"] == [f"vllm>={low},<{high}"]
