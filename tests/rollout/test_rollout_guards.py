"""Guards that need no engine: weight sync into a sleeping vLLM engine, unchecked cache resets (a stub engine
state, so the GPU-only paths are covered on the CPU), and the rollout dtype."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.config.rollout import RolloutConfig
from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout import vllm_setup
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.rollout.vllm_engine import VLLMEngine
from mmrlhf.testing.tiny_models import tiny_model_dir


class _StubLLM:
    """What VLLMEngine.update_weights touches on ``vllm.LLM``; records the calls."""

    def __init__(self, *, prefix_reset=True, sleeping=False, wakes=True):
        self.calls: list[str] = []
        self.asleep_tags: set[str] = set()
        self.prefix_reset, self.sleeping, self.wakes = prefix_reset, sleeping, wakes
        self.llm_engine = self  # engine-level methods live on the same stub

    def apply_model(self, fn):
        self.calls.append("apply_model")
        return [(set(), {})]  # what _load_bucket returns: names loaded, held aliases

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.prefix_reset

    def reset_mm_cache(self):
        self.calls.append("reset_mm_cache")

    def reset_encoder_cache(self):
        self.calls.append("reset_encoder_cache")

    def is_sleeping(self):
        return self.sleeping

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")
        self.sleeping = True
        self.asleep_tags = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        """vLLM's contract: wake the tags (all when None); True once everything is resident (and ``wakes``)."""
        self.calls.append(f"wake_up({tags})")
        self.asleep_tags -= set(tags) if tags is not None else set(self.asleep_tags)
        self.sleeping = bool(self.asleep_tags) or not self.wakes
        return not self.sleeping


def _engine(llm: _StubLLM, *, supports_sleep=True, sleep_level=1) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: only the state update_weights / sleep read
    engine.llm, engine._asleep, engine.supports_sleep = llm, set(), supports_sleep
    engine.sleep_level = sleep_level
    engine._cpu, engine.bucket_bytes = False, 1 << 20
    engine.adapter = get_adapter(tiny_model_dir("qwen2_vl"))  # its weights go to the engine under their own names
    return engine


WEIGHTS = [("w", torch.zeros(2))]


def test_update_weights_is_refused_while_the_engine_sleeps():
    llm = _StubLLM()
    engine = _engine(llm)
    engine.sleep()
    with pytest.raises(RuntimeError, match="sleeps.*wake_up"):
        engine.update_weights(iter(WEIGHTS))
    assert llm.calls == ["sleep(1)"]  # nothing was pushed into offloaded weights
    engine.wake_up()
    assert engine.update_weights(iter(WEIGHTS)) == 1
    assert llm.calls == ["sleep(1)", "wake_up(['weights', 'kv_cache'])", "apply_model", "reset_prefix_cache",
                         "reset_mm_cache", "reset_encoder_cache"]


def test_weights_woken_alone_take_the_update_and_the_kv_cache_wakes_after():
    """The trainer's order: wake the weights (vLLM still reports the engine as sleeping: its KV cache is), load the
    new weights, then wake the KV cache; generation is refused until everything is awake."""
    llm = _StubLLM()
    engine = _engine(llm, sleep_level=2)
    engine.sleep()
    engine.wake_up(tags=("weights",))
    assert llm.is_sleeping()  # vLLM's view: not fully awake
    assert engine.update_weights(iter(WEIGHTS)) == 1  # but the weights are resident: the sync goes through
    with pytest.raises(RuntimeError, match=r"asleep \(\['kv_cache'\]\)"):
        engine.generate([], SamplingSettings())
    engine.wake_up(tags=("kv_cache",))
    engine.wake_up(tags=("kv_cache",))  # nothing left asleep: no second call into vLLM
    assert llm.calls[0] == "sleep(2)" and llm.calls[1] == "wake_up(['weights'])"
    assert llm.calls[2] == "apply_model" and llm.calls[-1] == "wake_up(['kv_cache'])"
    assert llm.calls.count("wake_up(['kv_cache'])") == 1 and not llm.is_sleeping()
    with pytest.raises(ValueError, match="unknown tags.*'weights', 'kv_cache'"):
        engine.wake_up(tags=("weight",))


def test_a_sleep_started_outside_the_engine_counts():
    with pytest.raises(RuntimeError, match="sleeps"):
        _engine(_StubLLM(sleeping=True)).update_weights(iter(WEIGHTS))


def test_a_refused_cache_reset_is_an_error():
    with pytest.raises(RuntimeError, match="reset_prefix_cache"):
        _engine(_StubLLM(prefix_reset=False)).update_weights(iter(WEIGHTS))


def test_a_partial_wake_up_is_an_error():
    engine = _engine(_StubLLM(wakes=False))
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake"):
        engine.wake_up()


def test_rollout_dtype(monkeypatch):
    assert RolloutConfig().dtype == "auto"
    monkeypatch.setattr(vllm_setup, "cuda_available", lambda: False)
    assert vllm_setup.engine_dtype("auto") == "float32"  # CPU: fp32 is the fast and exact choice
    monkeypatch.setattr(vllm_setup, "cuda_available", lambda: True)
    assert vllm_setup.engine_dtype("auto") == "bfloat16"
    assert vllm_setup.engine_dtype("float16") == "float16"
    with pytest.raises(ValueError, match="rollout dtype"):
        vllm_setup.engine_dtype("fp8")


def test_build_engine_takes_the_rollout_dtype_not_the_trainers(monkeypatch, tiny_qwen2_vl):
    """The vLLM engine gets rollout.dtype (an fp32 trainer must not make it fp32); the transformers engine shares
    the actor's module, so a different rollout.dtype is an error, not silently ignored."""
    import mmrlhf.rollout.vllm_engine as vllm_engine
    from mmrlhf.rollout.builder import build_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda *a, **kw: seen.update(kw) or "engine")
    assert build_engine(RolloutConfig(dtype="bfloat16"), str(tiny_qwen2_vl)) == "engine"
    assert seen["dtype"] == "bfloat16"
    with pytest.raises(TypeError):
        build_engine(RolloutConfig(), str(tiny_qwen2_vl), dtype="float32")  # the trainer's dtype has no say

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl, dtype=torch.float32)
    tok = AutoProcessor.from_pretrained(tiny_qwen2_vl).tokenizer
    cfg = RolloutConfig(engine="transformers", dtype="bfloat16")
    with pytest.raises(ValueError, match="rollout.dtype=bfloat16.*float32"):
        build_engine(cfg, str(tiny_qwen2_vl), hf_model=model, tokenizer=tok)
    engine = build_engine(RolloutConfig(engine="transformers"), str(tiny_qwen2_vl), hf_model=model, tokenizer=tok)
    assert engine.tokenizer is tok  # stop strings work through the builder


def test_build_engine_passes_the_seed_mode_sleep_level_and_gpu_defaults(monkeypatch, tiny_qwen2_vl):
    """seed_mode auto is per_step on CUDA (vLLM's batched sampler) and per_sample elsewhere; the sleep level and the
    one-GPU defaults (CUDA graphs on, 0.35 of the GPU: docs/gpu.md) reach the engine."""
    import mmrlhf.rollout.vllm_engine as vllm_engine
    from mmrlhf.rollout.builder import build_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda *a, **kw: seen.update(kw) or "engine")
    for cuda, expected in ((True, "per_step"), (False, "per_sample")):
        monkeypatch.setattr(vllm_setup, "cuda_available", lambda cuda=cuda: cuda)
        build_engine(RolloutConfig(), str(tiny_qwen2_vl))
        assert seen["seed_mode"] == expected
        build_engine(RolloutConfig(seed_mode="per_sample", sleep_level=2), str(tiny_qwen2_vl))
        assert seen["seed_mode"] == "per_sample" and seen["sleep_level"] == 2
    assert seen["enforce_eager"] is False and seen["gpu_memory_utilization"] == 0.35
    with pytest.raises(ValueError, match="seed_mode"):
        RolloutConfig(seed_mode="per_call")


def test_stream_seeds_are_distinct_and_nearby_seeds_unrelated():
    from mmrlhf.rollout.types import mix_seed, request_seed, stream_seed

    n = 16
    streams = {stream_seed(7, i, j, n) for i in range(2000) for j in range(n)}
    assert len(streams) == 2000 * n  # every (request, sample) of a call has its own stream
    assert all(request_seed(7, i, n) % n == 0 for i in range(100))  # vLLM's child j adds j
    nearby = {stream_seed(8, i, j, n) for i in range(2000) for j in range(n)}
    assert not streams & nearby  # base seeds 7 and 8 share no stream (seed + i*n + j shared all but n)
    assert len({mix_seed(3, call) for call in range(10000)}) == 10000
    assert mix_seed(1, 2) != mix_seed(2, 1) and 0 <= mix_seed(2**70, -5) < 2**62
