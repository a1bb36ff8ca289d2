"""The vLLM engine: log-probs of the sampled distribution vs ActorVL at the sampling temperature, weight sync proven by
log-probs (tied embeddings included), one seed stream per sample, seeded batches that need several prefill steps
on the CPU, rollout dtype, too-long and rejected prompts named by record, CPU lifecycle."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout import vllm_setup
from mmrlhf.rollout.vllm_setup import has_recurrent_layers
from mmrlhf.rollout.types import GenerationRequest, PromptTooLongError, RequestRejectedError, SamplingSettings
from mmrlhf.testing.engine_check import default_cases, restricted_copy, solid_image
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE, FP32_TOLERANCE
from mmrlhf.testing.weights import perturb_
from rollout_helpers import actor_diffs, request_for

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

T = 0.7


@pytest.mark.parametrize("family, tied, dtype, tolerance", [
    ("qwen2_vl", True, "float32", FP32_TOLERANCE),  # fp32 engine vs fp32 trainer: tight
    ("qwen2_5_vl", False, "bfloat16", DEFAULT_TOLERANCE),  # the GPU default precision: bf16 noise
    # The current generation: linear-attention parameters (conv1d, A_log, dt_bias, in_proj_qkv / z / a / b) and
    # tied embeddings; the same with routed experts (per-expert in the checkpoint, fused in transformers' memory) and
    # a gated shared expert; Qwen3-VL-MoE's fused experts, stored transposed in its checkpoints.
    ("qwen3_5", True, "float32", FP32_TOLERANCE),
    # vLLM's own bf16 CPU kernels for the linear-attention layers (AVX-512 BF16 machines; elsewhere make_llm serves
    # float32 instead, tested above), against the float32 trainer at the bf16 tolerance.
    pytest.param("qwen3_5", True, "bfloat16", DEFAULT_TOLERANCE, marks=pytest.mark.skipif(
        not vllm_setup.cpu_has_bf16_kernels(),
        reason="vLLM's bf16 linear-attention CPU kernels need AVX-512 BF16; without it the engine serves float32")),
    ("qwen3_5_moe", False, "float32", FP32_TOLERANCE),
    ("qwen3_vl_moe", False, "float32", FP32_TOLERANCE),
])
@pytest.mark.slow  # ~20-30 s on the 2-core machine: engine start, three generations, ActorVL scoring
def test_logprobs_match_the_actor_at_temperature_and_sync_is_verified(family, tied, dtype, tolerance):
    """Engine log-probs at T=0.7 against ActorVL at T=0.7 (excluding the tokens the engine forbids, as its
    sampling distribution does); the plain actor differs by that excluded mass only; a trainer step without a
    sync is flagged on every case (text, image, two images, video); after update_weights the engine agrees again
    (a missed vision tower, a stale encoder cache or, for tied embeddings, a missed head would fail)."""
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    # vLLM's bf16 linear-attention kernels take a head size of 64 or more (the tiny default is 32)
    hybrid_bf16 = dtype == "bfloat16" and has_recurrent_layers(str(tiny_model_dir(family)))
    path = str(tiny_model_dir(family, tied=tied, **({"linear_head_dim": 64} if hybrid_bf16 else {})))
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    engine = VLLMEngine(path, adapter, max_model_len=1024, weight_sync_bucket_mb=1, dtype=dtype,
                        limit_mm_per_prompt={"image": 2, "video": 1})
    assert str(engine.llm.llm_engine.model_config.dtype) == f"torch.{dtype}"
    trainer = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    forbidden = adapter.vision_special_token_ids()
    stops = [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    requests = [request_for(processor, adapter, c) for c in default_cases(processor)]
    settings = SamplingSettings(n=2, max_new_tokens=12, seed=3, temperature=T)

    def diffs(result, model):
        return actor_diffs(result, requests, ActorVL(model, adapter), temperature=T, stop_ids=stops)

    synced = engine.generate(requests, settings)
    worst, _ = diffs(synced, restricted_copy(trainer, forbidden))
    assert max(worst) < tolerance, worst
    if dtype == "float32":
        plain, lowest = diffs(synced, trainer)
        assert max(plain) < DEFAULT_TOLERANCE and lowest > -FP32_TOLERANCE, (plain, lowest)

    perturb_(trainer)
    stale, _ = diffs(synced, restricted_copy(trainer, forbidden))
    assert min(stale) > DEFAULT_TOLERANCE, stale  # without a sync every case disagrees

    named = list(trainer.state_dict().items())
    assert engine.update_weights(iter(named)) == len(named)
    after, _ = diffs(engine.generate(requests, settings), restricted_copy(trainer, forbidden))
    assert max(after) < tolerance, after
    engine.close()


@pytest.fixture(scope="module")
def small_context_engine():
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    path = str(tiny_model_dir("qwen2_vl"))
    engine = VLLMEngine(path, get_adapter(path), max_model_len=64, prompt_too_long="skip",
                        limit_mm_per_prompt={"image": 1, "video": 0})
    return engine, path


def test_too_long_prompt_is_skipped_and_counted(small_context_engine):
    engine, path = small_context_engine
    tok = AutoProcessor.from_pretrained(path).tokenizer
    short = "red green blue"
    long = " ".join(["red"] * 80)
    requests = [GenerationRequest(p, prompt_token_ids=tok(p)["input_ids"], request_id=f"rec-{k}")
                for k, p in enumerate((short, long, short))]
    result = engine.generate(requests, SamplingSettings(n=2, max_new_tokens=4, seed=0))
    assert set(result.skipped) == {1} and "max_model_len 64" in result.skipped[1]
    assert "record 'rec-1' (request 1)" in result.skipped[1]
    assert [o.request_index for o in result.outputs] == [0, 2]
    assert all(len(c.token_ids) >= 1 for o in result.outputs for c in o.completions)

    # Without prompt ids the pre-check cannot see the length: vLLM rejects the batch, and the engine isolates
    # the bad request instead of losing the batch.
    blind = [GenerationRequest(p, request_id=f"rec-{k}") for k, p in enumerate((short, long, short))]
    result = engine.generate(blind, SamplingSettings(max_new_tokens=4, seed=0))
    assert set(result.skipped) == {1} and "rejected by vLLM" in result.skipped[1]
    assert "record 'rec-1' (request 1)" in result.skipped[1]
    assert [o.request_index for o in result.outputs] == [0, 2]

    engine.prompt_too_long = "error"
    try:
        with pytest.raises(PromptTooLongError, match=r"record 'rec-1' \(request 1\)"):
            engine.generate(requests, SamplingSettings(max_new_tokens=4))
        with pytest.raises(PromptTooLongError, match=r"record 'rec-1' \(request 1\)"):
            engine.generate(blind, SamplingSettings(max_new_tokens=4))
    finally:
        engine.prompt_too_long = "skip"


def test_a_rejected_request_is_named_and_never_skipped(small_context_engine):
    """Two images where the engine allows one: an error naming the record, not a skip, not an anonymous batch
    error."""
    engine, path = small_context_engine
    processor = AutoProcessor.from_pretrained(path)
    chat = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "red?"}]}],
        add_generation_prompt=True)
    requests = [GenerationRequest("red"), GenerationRequest(chat, images=[solid_image((255, 0, 0))] * 2,
                                                            request_id="two-images")]
    with pytest.raises(RequestRejectedError, match=r"record 'two-images' \(request 1\)"):
        engine.generate(requests, SamplingSettings(max_new_tokens=2, seed=0))


def test_every_sample_of_a_call_has_its_own_stream(small_context_engine):
    """Identical prompts, n samples each: with request seeds seed + i, vLLM's child j (seed + i + j) of request 0
    and child j - 1 of request 1 shared a stream and came out identical. Now every sample's stream is its own
    (stream_seed): all distinct; a request's samples do not depend on the other requests of the call; and runs
    with nearby base seeds draw unrelated samples."""
    engine, _ = small_context_engine
    n = 3
    same = [GenerationRequest("red green blue") for _ in range(3)]
    samples = lambda result: [tuple(c.token_ids) for o in result.outputs for c in o.completions]  # noqa: E731
    result = engine.generate(same, SamplingSettings(n=n, max_new_tokens=8, seed=5))
    assert len(set(samples(result))) == len(samples(result)) == 9, samples(result)
    other_first = [GenerationRequest("What color is the square?"), *same[1:]]
    again = engine.generate(other_first, SamplingSettings(n=n, max_new_tokens=8, seed=5))
    assert samples(again)[n:] == samples(result)[n:]  # requests 1 and 2 drew exactly the same samples
    assert samples(again)[:n] != samples(result)[:n]  # control: request 0 changed
    nearby = engine.generate(same, SamplingSettings(n=n, max_new_tokens=8, seed=6))
    assert not set(samples(nearby)) & set(samples(result))  # seed 6 is not seed 5 shifted by one sample


def test_seeded_batch_larger_than_one_prefill_step(small_context_engine):
    """16 prompts of ~30 tokens with 16 seeded samples each (7,680 prompt tokens, more than one step's budget):
    with chunked prefill, vLLM rewinds the generator of a partly prefilled request, which crashed on the CPU
    ("CPU Generator does not use offset")."""
    engine, path = small_context_engine
    tok = AutoProcessor.from_pretrained(path).tokenizer
    words = "red green blue yellow purple orange black white cyan pink brown gray".split()
    prompts = [" ".join(words[(k + j) % len(words)] for j in range(30)) for k in range(16)]
    requests = [GenerationRequest(p, prompt_token_ids=tok(p)["input_ids"]) for p in prompts]
    assert sum(len(r.prompt_token_ids) for r in requests) * 16 > 4096
    result = engine.generate(requests, SamplingSettings(n=16, max_new_tokens=2, seed=9))
    assert not result.skipped and len(result.outputs) == 16
    assert all(len(o.completions) == 16 and all(c.token_ids for c in o.completions) for o in result.outputs)


def test_seeds_reproduce_and_lifecycle_is_a_noop_on_cpu(small_context_engine):
    engine, _ = small_context_engine
    assert str(engine.llm.llm_engine.model_config.dtype) == "torch.float32"  # rollout dtype auto on the CPU
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


def test_sampling_params_forbid_the_union_and_stride_seeds_by_n():
    """No engine needed: the parameters each request gets."""
    from mmrlhf.rollout.types import stream_seed
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.adapter = get_adapter(str(tiny_model_dir("qwen2_vl")))
    engine.seed_mode = "per_sample"
    vision = engine.adapter.vision_special_token_ids()
    settings = SamplingSettings(n=4, seed=100, forbidden_token_ids=(7, 8))
    params = [engine._sampling_params(settings, GenerationRequest("p"), i) for i in range(3)]
    assert all(set(p.logit_bias) == set(vision) | {7, 8} for p in params)
    assert all(v <= -100 for p in params for v in p.logit_bias.values())
    streams = [p.seed + j for p in params for j in range(settings.n)]  # vLLM's child j: request seed + j
    assert streams == [stream_seed(100, i, j, 4) for i in range(3) for j in range(4)]
    assert len(set(streams)) == 12
    own = GenerationRequest("p", seed=4000)  # a request with its own seed keeps it, at any index, in either mode
    assert [engine._sampling_params(settings, own, i).seed for i in range(3)] == [4000] * 3
    engine.seed_mode = "per_step"  # the call seeds the default generators instead: no request carries a seed
    assert [engine._sampling_params(settings, GenerationRequest("p"), i).seed for i in range(3)] == [None] * 3
    assert engine._sampling_params(settings, own, 2).seed == 4000
    assert engine._sampling_params(settings, GenerationRequest("p"), 0).logit_bias == params[0].logit_bias


def test_make_llm_arguments(monkeypatch):
    """Rollout dtype, processed log-probs and (CPU) no chunked prefill, as passed to vllm.LLM."""
    import vllm

    from mmrlhf.rollout import vllm_setup

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kw: seen.update(kw) or "llm")
    path = str(tiny_model_dir("qwen2_vl"))
    assert vllm_setup.make_llm(path, max_model_len=8192) == "llm"
    assert seen["dtype"] == "float32" and seen["logprobs_mode"] == "processed_logprobs"
    assert seen["enable_chunked_prefill"] is False and seen["max_num_batched_tokens"] == 8192
    vllm_setup.make_llm(path, max_model_len=64, dtype="bfloat16")
    assert seen["dtype"] == "bfloat16" and seen["max_num_batched_tokens"] == vllm_setup.CPU_MAX_BATCHED_TOKENS


def test_a_bf16_engine_of_a_hybrid_model_needs_the_cpus_bf16_kernels_or_serves_float32(monkeypatch, caplog):
    """vLLM's bf16 CPU kernels for linear-attention layers are built on AVX-512 BF16: on a CPU without it a bf16
    Qwen3.5 engine serves float32 (this package's torch path) with a warning saying why; with it, bf16 as asked. A
    model without such layers keeps bf16 either way."""
    import logging

    import vllm

    from mmrlhf.rollout import vllm_setup

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kw: seen.update(kw) or "llm")
    hybrid, plain = str(tiny_model_dir("qwen3_5")), str(tiny_model_dir("qwen2_vl"))
    monkeypatch.setattr(vllm_setup, "cpu_has_bf16_kernels", lambda: False)
    with caplog.at_level(logging.WARNING, logger="mmrlhf.rollout.vllm_setup"):
        vllm_setup.make_llm(hybrid, max_model_len=256, dtype="bfloat16")
    assert seen["dtype"] == "float32" and "AVX-512 BF16" in caplog.text and hybrid in caplog.text
    caplog.clear()
    vllm_setup.make_llm(plain, max_model_len=256, dtype="bfloat16")
    assert seen["dtype"] == "bfloat16" and not caplog.text
    monkeypatch.setattr(vllm_setup, "cpu_has_bf16_kernels", lambda: True)
    vllm_setup.make_llm(hybrid, max_model_len=256, dtype="bfloat16")
    assert seen["dtype"] == "bfloat16" and not caplog.text
    vllm_setup.make_llm(hybrid, max_model_len=256)  # auto on the CPU: float32, no warning
    assert seen["dtype"] == "float32" and not caplog.text
    assert vllm_setup.recurrent_cpu_dtype("float32", False) == ("float32", None)


def test_seed_modes_per_request_seeds_or_one_seeded_call(small_context_engine):
    """``per_sample`` gives every request its own SamplingParams.seed (vLLM's per-request generator path);
    ``per_step`` sends none and seeds the default generators once per call: the same seed gives the same tokens,
    another call seed other tokens, the samples of a call stay distinct, and the caller's RNG is left as it was."""
    import dataclasses

    from mmrlhf.rollout.types import request_seed

    engine, _ = small_context_engine
    sent: list = []
    real = engine.llm.generate

    def recording(inputs, params, **kwargs):
        sent.append([p.seed for p in params])
        return real(inputs, params, **kwargs)

    ids = lambda r: [tuple(c.token_ids) for o in r.outputs for c in o.completions]  # noqa: E731
    requests = [GenerationRequest("red green"), GenerationRequest("blue")]
    settings = SamplingSettings(n=3, max_new_tokens=8, seed=11)
    engine.llm.generate = recording
    try:
        engine.generate(requests, settings)
        assert sent == [[request_seed(11, 0, 3), request_seed(11, 1, 3)]]
        engine.seed_mode = "per_step"
        sent.clear()
        torch.manual_seed(123)
        expected_next = torch.rand(4)
        torch.manual_seed(123)
        a = engine.generate(requests, settings)
        assert torch.equal(torch.rand(4), expected_next)  # the trainer's stream does not see the rollout
        b = engine.generate(requests, settings)
        c = engine.generate(requests, dataclasses.replace(settings, seed=12))
        assert sent == [[None, None]] * 3
        assert ids(a) == ids(b) and ids(a) != ids(c)
        assert len(set(ids(a))) == len(ids(a)) == 6
    finally:
        engine.seed_mode = "per_sample"
        del engine.llm.generate


class _Orphan:
    """What an in-process engine that was never closed leaves behind: an object in a reference cycle whose
    finaliser (vLLM's engine-core shutdown) destroys vLLM's process-wide parallel groups."""

    def __init__(self, ran: list[str]) -> None:
        import weakref

        from vllm.distributed import parallel_state

        self.me = self  # a cycle: only the garbage collector frees it
        weakref.finalize(self, lambda: (ran.append("shutdown"), parallel_state.destroy_model_parallel()))


@pytest.mark.parametrize("collect_first", [True, False], ids=["make_llm", "control"])
def test_an_orphaned_engines_shutdown_goes_before_the_next_engine(monkeypatch, tiny_qwen2_vl, collect_first):
    """An unclosed engine in a reference cycle is shut down when the collector finds it; vLLM collects garbage while
    it loads a model, after it made the new engine's groups, so the orphan's shutdown would tear those down and the
    new engine's first step fail ("pipeline model parallel group is not initialized"; seen when a test leaves an
    engine behind). make_llm collects before it builds (and freezes the heap, so vLLM's collections never reach what
    was there before). Control: without either the step fails."""
    import vllm

    if not collect_first:
        monkeypatch.setattr(vllm_setup, "settle_heap", lambda: None)
    import gc

    ran: list[str] = []
    held = [_Orphan(ran)]
    gc.collect()  # it survives into the oldest generation, which only a full collection looks at (as an engine
    held.clear()  # left by an earlier test), and then becomes garbage
    llm = vllm_setup.make_llm(str(tiny_qwen2_vl), dtype="float32", max_model_len=256, seed=0)
    try:
        assert ran == ["shutdown"]
        params = vllm.SamplingParams(max_tokens=3, temperature=0.0)
        if collect_first:
            assert len(llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
        else:
            with pytest.raises(AssertionError, match="not initialized"):
                llm.generate(["hello"], params, use_tqdm=False)
    finally:
        client = llm.llm_engine.engine_core
        client.shutdown()
