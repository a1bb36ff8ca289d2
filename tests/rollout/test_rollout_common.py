"""Engine-independent pieces: weight buckets, the transformers engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.base import iter_buckets
from mmrlhf.rollout.hf_engine import HFGenerateEngine
from mmrlhf.rollout.types import PromptTooLongError, SamplingSettings
from mmrlhf.testing.engine_check import default_cases, hf_response_logprobs
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.weights import perturb_
from rollout_helpers import request_for


def test_buckets_are_bounded_and_ordered():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]  # float32: 4 bytes each
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=100))
    assert [name for b in buckets for name, _ in b] == [n for n, _ in tensors]
    for b in buckets:
        size = sum(t.numel() * 4 for _, t in b)
        assert size <= 100 or len(b) == 1  # an oversized tensor travels alone
    assert [len(b) for b in buckets] == [2, 1, 1, 1, 1]  # 80 | 120 | 20 | 400 | 4 bytes
    with pytest.raises(ValueError):
        list(iter_buckets(iter(tensors), 0))


@pytest.fixture(scope="module")
def hf_setup():
    path = tiny_model_dir("qwen2_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tok = processor.tokenizer
    engine = HFGenerateEngine(model, get_adapter(path), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                              pad_token_id=tok.pad_token_id, max_model_len=256, batch_size=3)
    return engine, model, processor


def test_hf_engine_mixed_batch_logprobs_match_a_forward(hf_setup):
    engine, model, processor = hf_setup
    cases = default_cases(processor)
    requests = [request_for(processor, engine.adapter, c) for c in cases]
    result = engine.generate(requests, SamplingSettings(n=2, max_new_tokens=12, seed=5))
    assert [o.request_index for o in result.outputs] == [0, 1, 2, 3]
    for case, out in zip(cases, result.outputs):
        hf = hf_response_logprobs(model, processor, case, [c.token_ids for c in out.completions])
        for c, h in zip(out.completions, hf):
            assert not set(c.token_ids) & set(engine.adapter.vision_special_token_ids())
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == engine.eos_token_id
            else:
                assert len(c.token_ids) == 12
            # Batched left-padded generation vs an unpadded single forward, both float32.
            assert torch.allclose(torch.tensor(c.logprobs), h, atol=1e-4), (case.name, c.logprobs, h)


def test_hf_engine_skips_or_errors_on_too_long(hf_setup):
    engine, _, processor = hf_setup
    tok = processor.tokenizer
    from mmrlhf.rollout.types import GenerationRequest

    reqs = [GenerationRequest(p, prompt_token_ids=tok(p)["input_ids"]) for p in ("red", " ".join(["blue"] * 300))]
    result = engine.generate(reqs, SamplingSettings(max_new_tokens=4, seed=0))
    assert list(result.skipped) == [1] and [o.request_index for o in result.outputs] == [0]
    engine.prompt_too_long = "error"
    try:
        with pytest.raises(PromptTooLongError, match="request 1"):
            engine.generate(reqs, SamplingSettings(max_new_tokens=4))
    finally:
        engine.prompt_too_long = "skip"


def test_hf_engine_update_weights_copies_and_rejects_unknown_names(hf_setup):
    engine, model, _ = hf_setup
    path = tiny_model_dir("qwen2_vl")
    trainer = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    perturb_(trainer, seed=1)
    sd = trainer.state_dict()
    assert engine.update_weights(iter(sd.items())) == len(sd)
    for name, p in model.state_dict().items():
        assert torch.equal(p, sd[name]), name
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.update_weights(iter([("nope", torch.zeros(1))]))


@pytest.mark.parametrize(
    "row, expected",
    [
        ([5, 6, 2, 0, 0], ([5, 6, 2], "stop")),  # EOS (2) then fill (pad 0)
        ([5, 6, 7, 0, 0], ([5, 6, 7], "stop")),  # stop string: no stop token, fill after it
        ([5, 6, 7, 8, 9], ([5, 6, 7, 8, 9], "length")),  # ran to max_new_tokens
        ([5, 0, 7, 8, 9], ([5, 0, 7, 8, 9], "length")),  # a sampled pad in the middle is a real token
    ],
)
def test_generate_rows_are_cut_at_their_real_end(row, expected):
    from mmrlhf.rollout.hf_engine import _cut_generated

    assert _cut_generated(row, {2}, pad_id=0) == expected
    if row[-1] == 0:  # pad is itself a stop token (real Qwen models): the first fill token is the sampled EOS
        assert _cut_generated([5, 6, 0, 0], {2, 0}, pad_id=0) == ([5, 6, 0], "stop")


def test_hf_generate_leaves_the_global_rng_alone(hf_setup):
    engine, _, processor = hf_setup
    from mmrlhf.rollout.types import GenerationRequest

    req = [GenerationRequest("red", prompt_token_ids=processor.tokenizer("red")["input_ids"])]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(req, SamplingSettings(max_new_tokens=3, seed=7))
    assert torch.equal(torch.rand(3), expected)
