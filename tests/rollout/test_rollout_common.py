"""Engine-independent pieces and the transformers engine: weight buckets, the sampled distribution and its
log-probs (vs ActorVL at the sampling temperature), per-sample seed streams, stop strings, forbidden tokens, tied
embeddings, record ids in errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.base import forbidden_token_ids, iter_buckets
from mmrlhf.rollout.hf_engine import HFGenerateEngine
from mmrlhf.rollout.types import GenerationRequest, PromptTooLongError, SamplingSettings
from mmrlhf.testing.engine_check import default_cases, hf_response_logprobs, restricted_copy
from mmrlhf.testing.tiny_models import RELEASED_GENERATION_DEFAULTS, tiny_model_dir
from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE, FP32_TOLERANCE
from mmrlhf.testing.weights import perturb_
from rollout_helpers import actor_diffs, request_for

T = 0.7  # a sampling temperature other than 1: engine and trainer must agree on the tempered distribution


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


def _engine(path, **kwargs):
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tok = processor.tokenizer
    engine = HFGenerateEngine(model, get_adapter(path), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                              pad_token_id=tok.pad_token_id, max_model_len=256, batch_size=3, **kwargs)
    return engine, model, processor


@pytest.fixture(scope="module", params=["untied", "tied"])
def hf_setup(request):
    return _engine(tiny_model_dir("qwen2_vl", tied=request.param == "tied"), tokenizer=None)


def test_hf_engine_mixed_batch_logprobs_are_the_sampled_distribution(hf_setup):
    """Batched left-padded generation vs an unpadded single fp32 forward of the same distribution (vision special
    tokens excluded, logits / T)."""
    engine, model, processor = hf_setup
    cases = default_cases(processor)
    requests = [request_for(processor, engine.adapter, c) for c in cases]
    result = engine.generate(requests, SamplingSettings(n=2, max_new_tokens=12, seed=5, temperature=T))
    assert [o.request_index for o in result.outputs] == [0, 1, 2, 3]
    forbidden = engine.adapter.vision_special_token_ids()
    for case, out in zip(cases, result.outputs):
        ref = hf_response_logprobs(model, processor, case, [c.token_ids for c in out.completions], temperature=T,
                                   forbidden=forbidden)
        for c, h in zip(out.completions, ref):
            assert not set(c.token_ids) & set(forbidden)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == engine.eos_token_id
            else:
                assert len(c.token_ids) == 12
            assert torch.allclose(torch.tensor(c.logprobs), h, atol=FP32_TOLERANCE), (case.name, c.logprobs, h)


@pytest.mark.slow  # ~20 s on the 2-core machine: two mixed-batch generations, five ActorVL scorings
def test_hf_engine_logprobs_match_the_actor_at_temperature_and_flag_a_stale_engine():
    """The trainer's view: ActorVL at the sampling temperature. Tight against an actor that excludes the forbidden
    tokens as the sampler does; the plain actor differs only by that excluded mass (engine >= actor). A trainer
    whose weights moved without a sync is flagged; after update_weights (tied embeddings: lm_head.weight is in the
    trainer's state_dict under its own name) the engine agrees again."""
    path = tiny_model_dir("qwen2_vl", tied=True)
    engine, _, processor = _engine(path)
    adapter, forbidden = engine.adapter, engine.adapter.vision_special_token_ids()
    trainer = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    requests = [request_for(processor, adapter, c) for c in default_cases(processor)]
    settings = SamplingSettings(n=2, max_new_tokens=10, seed=1, temperature=T)

    def diffs(result, actor_model):
        return actor_diffs(result, requests, ActorVL(actor_model, adapter), temperature=T, stop_ids=engine.stop_ids)

    synced = engine.generate(requests, settings)
    assert max(diffs(synced, restricted_copy(trainer, forbidden))[0]) < FP32_TOLERANCE
    plain, lowest = diffs(synced, trainer)
    assert max(plain) < DEFAULT_TOLERANCE and lowest > -FP32_TOLERANCE, (plain, lowest)

    perturb_(trainer, seed=3)  # a trainer step; the engine still serves the old weights (and samples)
    stale, _ = diffs(synced, restricted_copy(trainer, forbidden))
    assert min(stale) > DEFAULT_TOLERANCE, stale  # every case flagged

    state = trainer.state_dict()
    assert "lm_head.weight" in state and "lm_head.weight" not in dict(trainer.named_parameters())
    assert engine.update_weights(iter(state.items())) == len(state)
    after = engine.generate(requests, settings)
    assert max(diffs(after, restricted_copy(trainer, forbidden))[0]) < FP32_TOLERANCE


def test_hf_engine_ignores_the_checkpoints_generation_defaults(monkeypatch):
    """A checkpoint whose generation_config.json carries released Instruct defaults (repetition penalty 1.05,
    top_k 1, ...): the engine samples from what SamplingSettings says only. ``generate`` builds no logits processor
    of its own (a merged repetition penalty would add one); samples differ (top_k 1 would make them equal); the
    log-probs are those of the plain tempered distribution."""
    path = tiny_model_dir("qwen2_vl", released_generation_config=True)
    engine, model, processor = _engine(path)
    assert model.generation_config.repetition_penalty == RELEASED_GENERATION_DEFAULTS["repetition_penalty"]
    built = []
    original = model._get_logits_processor  # transformers' assembly of the processors generate applies

    def spy(*args, **kwargs):
        built.append([type(p).__name__ for p in original(*args, **kwargs)])
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "_get_logits_processor", spy)
    case = default_cases(processor)[1]  # one image
    result = engine.generate([request_for(processor, engine.adapter, case)],
                             SamplingSettings(n=6, max_new_tokens=8, seed=0, temperature=T))
    assert built == [["SettingsSampler"]], built
    samples = [tuple(c.token_ids) for c in result.outputs[0].completions]
    assert len(set(samples)) > 1, samples
    ref = hf_response_logprobs(model, processor, case, [list(s) for s in samples], temperature=T,
                               forbidden=engine.adapter.vision_special_token_ids())
    for c, h in zip(result.outputs[0].completions, ref):
        assert torch.allclose(torch.tensor(c.logprobs), h, atol=FP32_TOLERANCE)
    assert model.generation_config.top_k == RELEASED_GENERATION_DEFAULTS["top_k"]  # put back after the call


def test_hf_engine_gives_every_sample_its_own_stream(hf_setup):
    """Identical prompts: no two samples of a call are equal (no shared noise), and a sample is the same whichever
    engine batch it is generated in (its stream depends on its seed, request and sample index only)."""
    engine, _, processor = hf_setup
    ids = processor.tokenizer("red green blue")["input_ids"]
    same = [GenerationRequest("p", prompt_token_ids=list(ids)) for _ in range(3)]
    n = 3
    samples = lambda result: [tuple(c.token_ids) for o in result.outputs for c in o.completions]  # noqa: E731
    result = engine.generate(same, SamplingSettings(n=n, max_new_tokens=8, seed=21))
    assert len(set(samples(result))) == len(samples(result)) == 9, samples(result)
    size = engine.batch_size
    engine.batch_size = 1  # every request in a batch of its own
    try:
        split = engine.generate(same, SamplingSettings(n=n, max_new_tokens=8, seed=21))
    finally:
        engine.batch_size = size
    assert samples(split) == samples(result)
    nearby = engine.generate(same, SamplingSettings(n=n, max_new_tokens=8, seed=22))
    assert not set(samples(nearby)) & set(samples(result))  # seed 22 is not seed 21 shifted by one sample


def test_hf_engine_request_seeds_follow_the_request_not_the_call(hf_setup):
    """A request that carries its own seed (GenerationRequest.seed) draws its samples from seed + j wherever it
    sits in a call and whatever the call's seed; control: without it, the same request moved to another position
    draws other tokens."""
    import dataclasses

    engine, _, processor = hf_setup
    ids = processor.tokenizer("red green blue")["input_ids"]
    own = GenerationRequest("p", prompt_token_ids=list(ids), seed=3000)
    other = GenerationRequest("q", prompt_token_ids=list(ids))
    samples = lambda result, i: [tuple(c.token_ids) for c in result.outputs[i].completions]  # noqa: E731
    first = engine.generate([own, other], SamplingSettings(n=2, max_new_tokens=8, seed=21))
    moved = engine.generate([other, other, own], SamplingSettings(n=2, max_new_tokens=8, seed=99))
    assert samples(moved, 2) == samples(first, 0)
    plain = dataclasses.replace(own, seed=None)
    a = engine.generate([plain, other], SamplingSettings(n=2, max_new_tokens=8, seed=21))
    b = engine.generate([other, other, plain], SamplingSettings(n=2, max_new_tokens=8, seed=21))
    assert samples(a, 0) != samples(b, 2)


def test_hf_engine_stop_strings(hf_setup):
    engine, model, processor = hf_setup
    tok = processor.tokenizer
    req = [GenerationRequest("p", prompt_token_ids=tok("What color is the square?")["input_ids"])]
    settings = SamplingSettings(n=6, max_new_tokens=16, seed=2, stop=("e",))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(req, settings)  # a clear error, not transformers' own crash deep inside generate
    with_tok = HFGenerateEngine(model, engine.adapter, eos_token_id=engine.eos_token_id,
                                pad_token_id=engine.pad_token_id, tokenizer=tok, max_model_len=256)
    completions = with_tok.generate(req, settings).outputs[0].completions
    stopped = [c for c in completions if c.finish_reason == "stop" and c.token_ids[-1] not in with_tok.stop_ids]
    assert stopped, [tok.decode(c.token_ids) for c in completions]
    for c in stopped:  # ended by the stop string: at the token that completes its first occurrence
        assert "e" in tok.decode(c.token_ids) and "e" not in tok.decode(c.token_ids[:-1])
        assert len(c.logprobs) == len(c.token_ids)


def test_forbidden_tokens_add_to_the_vision_tokens(hf_setup):
    """A caller's forbidden list adds to the vision special tokens. The model is pushed to favour them (a +12 logit
    bias), so a list that replaced them would let them through at once."""
    engine, model, processor = hf_setup
    vision = engine.adapter.vision_special_token_ids()
    user = [processor.tokenizer.convert_tokens_to_ids("<|im_start|>")]
    settings = SamplingSettings(n=4, max_new_tokens=6, seed=0, forbidden_token_ids=tuple(user))
    boost = torch.zeros(model.get_output_embeddings().weight.shape[0])
    boost[vision + user] = 12.0
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, out: out + boost)
    try:
        req = [GenerationRequest("p", prompt_token_ids=processor.tokenizer("red")["input_ids"])]
        toks = [t for c in engine.generate(req, settings).outputs[0].completions for t in c.token_ids]
    finally:
        hook.remove()
    assert toks and not set(toks) & set(vision + user), toks
    assert forbidden_token_ids(engine.adapter, settings) == sorted(set(vision) | set(user))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(req, SamplingSettings(max_new_tokens=2, forbidden_token_ids=(10**6,)))


def test_hf_engine_skips_or_errors_on_too_long_naming_the_record(hf_setup):
    engine, _, processor = hf_setup
    tok = processor.tokenizer
    prompts = ("red", " ".join(["blue"] * 300))
    reqs = [GenerationRequest(p, prompt_token_ids=tok(p)["input_ids"], request_id=f"rec-{k}")
            for k, p in enumerate(prompts)]
    result = engine.generate(reqs, SamplingSettings(max_new_tokens=4, seed=0))
    assert list(result.skipped) == [1] and [o.request_index for o in result.outputs] == [0]
    assert "record 'rec-1' (request 1)" in result.skipped[1]
    engine.prompt_too_long = "error"
    try:
        with pytest.raises(PromptTooLongError, match=r"record 'rec-1' \(request 1\)"):
            engine.generate(reqs, SamplingSettings(max_new_tokens=4))
        anonymous = [GenerationRequest(p, prompt_token_ids=tok(p)["input_ids"]) for p in prompts]
        with pytest.raises(PromptTooLongError, match="^request 1:"):
            engine.generate(anonymous, SamplingSettings(max_new_tokens=4))
    finally:
        engine.prompt_too_long = "skip"
    with pytest.raises(ValueError, match="record 'x' \\(request 0\\): .*prompt_token_ids"):
        engine.generate([GenerationRequest("p", request_id="x")], SamplingSettings(max_new_tokens=2))


def test_hf_engine_update_weights_copies_and_rejects_unknown_names(hf_setup):
    engine, model, _ = hf_setup
    trainer = AutoModelForImageTextToText.from_pretrained(model.name_or_path, dtype=torch.float32)
    perturb_(trainer, seed=1)
    sd = trainer.state_dict()  # a tied model lists lm_head.weight too (the embedding, under its own name)
    assert engine.update_weights(iter(sd.items())) == len(sd)
    for name, p in model.state_dict().items():
        assert torch.equal(p, sd[name]), name
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.update_weights(iter([("nope", torch.zeros(1))]))


@pytest.mark.parametrize(
    "generated, drawn, expected",
    [
        ([5, 6, 2, 0, 0], [5, 6, 2, 7, 8], ([5, 6, 2], "stop")),  # EOS (2), then fill (pad 0) instead of draws
        ([5, 6, 7, 0, 0], [5, 6, 7, 9, 9], ([5, 6, 7], "stop")),  # stop string: no stop token, fill after it
        ([5, 6, 7, 8, 9], [5, 6, 7, 8, 9], ([5, 6, 7, 8, 9], "length")),  # ran to max_new_tokens
        ([5, 6, 7, 0, 0], [5, 6, 7, 0, 0], ([5, 6, 7, 0, 0], "length")),  # sampled pads at the end are real
        ([5, 0, 7, 8, 9], [5, 0, 7, 8, 9], ([5, 0, 7, 8, 9], "length")),  # a sampled pad in the middle too
        ([5, 2, 0, 0, 0], [5, 2, 0, 3, 3], ([5, 2], "stop")),  # pad drawn right after EOS: cut at the EOS
    ],
)
def test_generate_rows_are_cut_at_their_real_end(generated, drawn, expected):
    from mmrlhf.rollout.hf_engine import _cut_row

    assert _cut_row(generated, drawn, {2}) == expected


def test_hf_generate_leaves_the_global_rng_alone(hf_setup):
    engine, _, processor = hf_setup
    req = [GenerationRequest("red", prompt_token_ids=processor.tokenizer("red")["input_ids"])]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(req, SamplingSettings(max_new_tokens=3, seed=7))
    engine.generate(req, SamplingSettings(max_new_tokens=3, seed=None))
    assert torch.equal(torch.rand(3), expected)
