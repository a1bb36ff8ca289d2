"""``rollout.logprob_mode``: with top-k / top-p / min-p, the trainer's ``sampled`` log-probs equal the engine's
processed log-probs (vLLM and the transformers engine, every family, text / one image / two images / video, float32
on both sides); ``full`` differs by the kept mass of each step (the control), so the importance ratio's mean is 1
under ``sampled`` and the mean kept mass under ``full``."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.models.truncation import Truncation
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.engine_check import actor_response_logprobs, default_cases
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.tolerances import FP32_TOLERANCE
from rollout_helpers import request_for

T = 0.8
# top-k 5 of a ~600-token vocabulary keeps little of a random model's mass (a strong control); top-p 0.7 keeps most
# of its tokens; min-p with top-p exercises the order (min-p first, then the nucleus of what it left).
SETTINGS = [Truncation(top_k=5), Truncation(top_p=0.7), Truncation(top_p=0.9, min_p=0.5)]
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _compare(engine, path, *, n: int = 3, max_new_tokens: int = 10) -> list[dict]:
    """Per setting: the engine's log-probs of its own samples against ActorVL's ``sampled`` and ``full`` ones."""
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    actor = ActorVL(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(), adapter)
    stops = [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    requests = [request_for(processor, adapter, c) for c in default_cases(processor)]
    report = []
    for t in SETTINGS:
        settings = SamplingSettings(n=n, max_new_tokens=max_new_tokens, seed=11, temperature=T, top_k=t.top_k,
                                    top_p=t.top_p, min_p=t.min_p)
        result = engine.generate(requests, settings)
        assert [o.request_index for o in result.outputs] == list(range(len(requests)))
        row: dict = {"setting": t, "sampled": {}, "full": [], "engine": []}
        for out in result.outputs:
            responses = [c.token_ids for c in out.completions]
            name = default_cases(processor)[out.request_index].name
            kw = dict(temperature=T, stop_ids=stops)
            sampled = actor_response_logprobs(actor, requests[out.request_index], responses, truncation=t, **kw)
            full = actor_response_logprobs(actor, requests[out.request_index], responses, **kw)
            eng = [torch.tensor(c.logprobs) for c in out.completions]
            row["sampled"][name] = max(float((e - s).abs().max()) for e, s in zip(eng, sampled))
            row["full"] += [f - s for f, s in zip(full, sampled)]  # log of the kept mass, per token
            row["engine"] += [(name, s - e, f - e) for s, f, e in zip(sampled, full, eng)]
        report.append(row)
    return report


def _check(report, *, unchecked: tuple[str, ...] = ()) -> None:
    for row in report:
        t = row["setting"]
        for case, diff in row["sampled"].items():  # every prompt kind
            assert case in unchecked or diff < FP32_TOLERANCE, (t, row["sampled"])
        log_kept = torch.cat(row["full"])  # [tokens] log kept mass (<= 0), every case (trainer-side only)
        assert float(log_kept.max()) < 1e-5, t  # truncation never lowers a kept token's probability
        compared = [(s, f) for case, s, f in row["engine"] if case not in unchecked]
        ratio_sampled = torch.cat([s for s, _ in compared]).exp()  # pi_trainer / mu_engine per token
        ratio_full = torch.cat([f for _, f in compared]).exp()
        assert abs(float(ratio_sampled.mean()) - 1.0) < 1e-4, (t, float(ratio_sampled.mean()))
        kept = float(torch.cat([f - s for s, f in compared]).exp().mean())  # mean kept mass
        # control: `full` is off by the kept mass, on every token where the truncation cut anything
        assert math.isclose(float(ratio_full.mean()), kept, rel_tol=1e-3), (t, float(ratio_full.mean()), kept)
        assert kept < 0.95, (t, kept)
        if t.top_k == 5:
            assert kept < 0.2, kept  # five of ~600 tokens of a random model
        assert float((ratio_full - 1).abs().max()) > 10 * FP32_TOLERANCE


@pytest.mark.slow  # ~25 s a family on the 2-core machine: engine start, three generations, six scorings per case
@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_processed_logprobs_equal_the_trainers_sampled_logprobs(family):
    pytest.importorskip("vllm")
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    path = str(tiny_model_dir(family))
    engine = VLLMEngine(path, get_adapter(path), max_model_len=1024, dtype="float32",
                        limit_mm_per_prompt={"image": 2, "video": 1})
    try:
        _check(_compare(engine, path))
    finally:
        engine.close()


@pytest.mark.slow  # ~15 s a family: three generations through transformers generate
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_engine_logprobs_equal_the_trainers_sampled_logprobs(family):
    from mmrlhf.rollout.hf_engine import HFGenerateEngine

    path = str(tiny_model_dir(family))
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tok = processor.tokenizer
    engine = HFGenerateEngine(model, get_adapter(path), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                              pad_token_id=tok.pad_token_id, max_model_len=512, batch_size=4)
    # transformers' generate places text after a Qwen2.5-VL video by its own M-RoPE rule, not vLLM's, which the
    # trainer follows (mmrlhf.models.mrope): the transformers engine samples that one case from another distribution
    # (1.8e-3 apart untruncated, 8.5e-3 with min-p 0.5), a gap of that engine's positions, not of the truncation.
    # vLLM's samples of the same case agree to FP32_TOLERANCE (the test above).
    _check(_compare(engine, path), unchecked=("video",) if family == "qwen2_5_vl" else ())
