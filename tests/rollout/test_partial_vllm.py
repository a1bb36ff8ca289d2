"""Partial rollouts with the vLLM engine (float32, CPU): an answer whose generation is interrupted by a weight update
continues under the new weights, and each segment's log-probs are exactly those of the version that sampled it, per
prompt kind (text, one image, two images, video); the control scores the later segment with the old version."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.base import stop_token_ids
from mmrlhf.rollout.partial import generate_in_segments
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.engine_check import actor_response_logprobs, default_cases, restricted_copy
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE, FP32_TOLERANCE
from mmrlhf.testing.weights import perturb_
from rollout_helpers import request_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~20 s: engine start, two segments, two scoring passes
pytest.importorskip("vllm")

T = 0.7


def test_a_response_spanning_two_versions_has_each_versions_log_probs_per_segment():
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    path = str(tiny_model_dir("qwen2_vl"))
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    engine = VLLMEngine(path, adapter, max_model_len=1024, weight_sync_bucket_mb=1, dtype="float32",
                        limit_mm_per_prompt={"image": 2, "video": 1})
    v0 = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    v1 = copy.deepcopy(v0)
    perturb_(v1)
    stops = stop_token_ids(v0, processor.tokenizer.eos_token_id,
                           [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")])
    # no answer may stop: every one crosses the boundary after its first 4 tokens (a minimum length would do it too,
    # but the engine then samples without the stop tokens only up to it, which the scorer below does not model)
    forbidden = [*adapter.vision_special_token_ids(), *stops]
    cases = default_cases(processor)
    requests = [request_for(processor, adapter, c, request_id=c.name) for c in cases]

    def boundary(segment: int) -> int:
        if segment == 1:  # the update arrives while segment 0 is generated: applied at the boundary
            engine.update_weights(iter(list(v1.state_dict().items())))
        return min(segment, 1)

    settings = SamplingSettings(n=2, max_new_tokens=12, seed=3, temperature=T, forbidden_token_ids=tuple(stops))
    result = generate_in_segments(engine, requests, settings, segment_tokens=4, boundary=boundary)
    assert result.segment_versions[:2] == [0, 1] and len(result.outputs) == len(cases)

    actors = {v: ActorVL(restricted_copy(m, forbidden), adapter) for v, m in ((0, v0), (1, v1))}
    worst = {0: [], 1: []}
    control = []
    for out in result.outputs:
        responses = [c.token_ids for c in out.completions]
        scored = {v: actor_response_logprobs(a, requests[out.request_index], responses, temperature=T,
                                             stop_ids=stops) for v, a in actors.items()}
        for j, c in enumerate(out.completions):
            versions = torch.tensor(c.token_versions)
            assert versions[:4].eq(0).all() and versions[4:].eq(1).all() and len(versions) == 12
            engine_lp = torch.tensor(c.logprobs)
            for v in (0, 1):
                worst[v].append(float((engine_lp - scored[v][j])[versions == v].abs().max()))
            control.append(float((engine_lp - scored[0][j])[versions == 1].abs().max()))
    print(f"\nper-segment |engine - own version| max: v0 {max(worst[0]):.2e}, v1 {max(worst[1]):.2e}; "
          f"second segment scored by v0 (control) min over answers {min(control):.2e}")
    assert max(worst[0]) < FP32_TOLERANCE and max(worst[1]) < FP32_TOLERANCE, worst
    assert min(control) > DEFAULT_TOLERANCE, control  # the second segment really came from the new weights
    engine.close()
