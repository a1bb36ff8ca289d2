"""The vLLM engine: weight sync proven by log-probs, too-long prompts isolated, reproducible seeds, CPU lifecycle."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.types import GenerationRequest, PromptTooLongError, SamplingSettings
from mmrlhf.testing.engine_check import default_cases, hf_response_logprobs
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE
from mmrlhf.testing.weights import perturb_
from rollout_helpers import request_for

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


def _worst_by_case(engine, model, processor, cases, requests, settings) -> dict[str, float]:
    result = engine.generate(requests, settings)
    worst = {}
    for case, out in zip(cases, result.outputs):
        hf = hf_response_logprobs(model, processor, case, [c.token_ids for c in out.completions])
        worst[case.name] = max(float((torch.tensor(c.logprobs) - h).abs().max()) for c, h in zip(out.completions, hf))
    return worst


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_weight_sync_is_verified_by_logprobs(family):
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    path = str(tiny_model_dir(family))
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    engine = VLLMEngine(path, adapter, max_model_len=1024, weight_sync_bucket_mb=1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    cases = default_cases(processor)
    requests = [request_for(processor, adapter, c) for c in cases]
    settings = SamplingSettings(n=2, max_new_tokens=16, seed=3)

    before = _worst_by_case(engine, model, processor, cases, requests, settings)
    assert max(before.values()) < DEFAULT_TOLERANCE, before

    perturb_(model)
    stale = _worst_by_case(engine, model, processor, cases, requests, settings)
    assert min(stale.values()) > DEFAULT_TOLERANCE, stale  # without a sync every case disagrees

    named = list(model.state_dict().items())
    assert engine.update_weights(iter(named)) == len(named)
    after = _worst_by_case(engine, model, processor, cases, requests, settings)
    # Image and video cases included: a sync that missed the vision tower or left the encoder cache stale fails.
    assert max(after.values()) < DEFAULT_TOLERANCE, after
    engine.close()


@pytest.fixture(scope="module")
def small_context_engine():
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    path = str(tiny_model_dir("qwen2_vl"))
    return VLLMEngine(path, get_adapter(path), max_model_len=64, prompt_too_long="skip"), path


def test_too_long_prompt_is_skipped_and_counted(small_context_engine):
    engine, path = small_context_engine
    tok = AutoProcessor.from_pretrained(path).tokenizer
    short = "red green blue"
    long = " ".join(["red"] * 80)
    requests = [GenerationRequest(p, prompt_token_ids=tok(p)["input_ids"]) for p in (short, long, short)]
    result = engine.generate(requests, SamplingSettings(n=2, max_new_tokens=4, seed=0))
    assert set(result.skipped) == {1} and "max_model_len 64" in result.skipped[1]
    assert [o.request_index for o in result.outputs] == [0, 2]
    assert all(len(c.token_ids) >= 1 for o in result.outputs for c in o.completions)

    # Without prompt ids the pre-check cannot see the length: vLLM rejects the batch, and the engine isolates
    # the bad request instead of losing the batch.
    blind = [GenerationRequest(short), GenerationRequest(long), GenerationRequest(short)]
    result = engine.generate(blind, SamplingSettings(max_new_tokens=4, seed=0))
    assert set(result.skipped) == {1} and "rejected by vLLM" in result.skipped[1]
    assert [o.request_index for o in result.outputs] == [0, 2]

    engine.prompt_too_long = "error"
    try:
        with pytest.raises(PromptTooLongError, match="request 1"):
            engine.generate(requests, SamplingSettings(max_new_tokens=4))
        with pytest.raises(PromptTooLongError, match="request 1"):
            engine.generate(blind, SamplingSettings(max_new_tokens=4))
    finally:
        engine.prompt_too_long = "skip"


def test_seeds_reproduce_and_lifecycle_is_a_noop_on_cpu(small_context_engine):
    engine, _ = small_context_engine
    requests = [GenerationRequest("red green"), GenerationRequest("blue")]
    settings = SamplingSettings(n=3, max_new_tokens=8, seed=11, temperature=1.0)
    a = engine.generate(requests, settings)
    engine.sleep()  # CUDA-only feature: a clean no-op here
    engine.wake_up()
    b = engine.generate(requests, settings)
    ids = lambda r: [[c.token_ids for c in o.completions] for o in r.outputs]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(engine.generate(requests, SamplingSettings(n=3, max_new_tokens=8, seed=12)))
    assert not engine.supports_sleep or torch.cuda.is_available()
    for out in a.outputs:
        for c in out.completions:
            assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids)
