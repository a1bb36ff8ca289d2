"""The trainer scores exactly what the engine sampled: a float32 vLLM engine and a float32 ActorVL agree on the
sampled tokens' log-probs to 1e-4, per family and prompt kind, in both layouts (padded and packed).

fp32 on both sides leaves only summation-order noise (~1e-6), so a position, vision-layout or masking difference
cannot hide under the bf16 tolerance (0.02) of the engine check. Controls that must fail: the same actor with text
positions after the first vision item shifted by one, and with the installed transformers' own M-RoPE rule
(``get_rope_index``), which places text after a video differently from the engine for Qwen2-VL (more temporal
patches than rows) and Qwen2.5-VL (time scaled by ``second_per_grid_ts * tokens_per_second``).

One engine per family (closed as soon as it has generated), a few tokens per prompt: slow only because building a
vLLM engine on the CPU takes ~15 s.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field

import pytest
import torch

from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models.actor import ActorVL
from mmrlhf.rollout.base import stop_token_ids
from mmrlhf.rollout.types import GenerationRequest, SamplingSettings
from mmrlhf.testing.engine_check import CheckCase, moving_square_video, processor_inputs, solid_image
from mmrlhf.testing.tiny_models import tiny_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"]
KINDS = ["text", "image", "two_images", "video", "image_video"]
VISION_KINDS = KINDS[1:]
VIDEO_KINDS = ["video", "image_video"]
FRAME_BY_FRAME = ("qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")  # the Qwen3 processors place videos so
TOLERANCE = 1e-4  # fp32 engine vs fp32 actor; measured ~1e-6
CAUGHT = 3 * TOLERANCE  # a control must move some log-prob by at least this much (measured >= 7e-4)
NON_PROMPT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def _cases(processor) -> list[CheckCase]:
    """One prompt per kind. The video has 8 frames of 56x56: 4 temporal patches of 2x2 merged tokens, so its
    temporal positions run past its spatial extent (where the libraries' rules differ)."""

    def chat(parts: list[dict]) -> str:
        return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)

    red, blue, video = solid_image((255, 0, 0)), solid_image((0, 0, 255), (84, 56)), moving_square_video(8)
    ask = {"type": "text", "text": "What do you see?"}
    return [
        CheckCase("text", chat([ask])),
        CheckCase("image", chat([{"type": "image"}, ask]), images=[red]),
        CheckCase("two_images", chat([{"type": "image"}, {"type": "image"}, ask]), images=[red, blue]),
        CheckCase("video", chat([{"type": "video"}, ask]), videos=[video]),
        CheckCase("image_video", chat([{"type": "image"}, {"type": "video"}, ask]), images=[blue], videos=[video]),
    ]


@dataclass
class Rollout:
    """What the fp32 engine sampled for one family, flattened to samples, plus the actor's scores (cached)."""

    bundle: object
    kinds: list[str]  # per sample
    prompts: list[list[int]]
    responses: list[list[int]]
    vision: list[dict[str, torch.Tensor]]
    engine_logprobs: list[torch.Tensor]  # per sample [A_i]
    stops: list[int]
    cache: dict = field(default_factory=dict)

    def diffs(self, adapter, layout: str) -> dict[str, float]:
        """kind -> max |actor - engine| log-prob over that kind's samples, scoring with ``adapter``'s positions."""
        build = build_padded_samples if layout == "padded" else build_packed_samples
        built = build(self.prompts, self.responses, pad_id=self.bundle.processor.tokenizer.pad_token_id,
                      eos_id=self.stops, adapter=self.bundle.adapter, vision=self.vision)
        with torch.no_grad():
            out = ActorVL(self.bundle.model, adapter, chunk_size=7)(built.samples, vision_extra=built.vision_extra)
        worst: dict[str, float] = {}
        for i, (kind, engine) in enumerate(zip(self.kinds, self.engine_logprobs)):
            n = int(built.samples.response_length[i])
            assert n == engine.numel(), (kind, i)  # the builder kept every sampled token
            diff = float((out.log_probs[i, :n] - engine).abs().max())
            worst[kind] = max(worst.get(kind, 0.0), diff)
        return worst

    def actor_diffs(self, layout: str) -> dict[str, float]:
        if layout not in self.cache:
            self.cache[layout] = self.diffs(self.bundle.adapter, layout)
        return self.cache[layout]


@pytest.fixture(scope="module", params=FAMILIES)
def rollout(request, bundles) -> Rollout:
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    bundle = bundles[request.param]
    cases = _cases(bundle.processor)
    inputs = [processor_inputs(bundle.processor, bundle.adapter, case) for case in cases]
    requests = [
        GenerationRequest(prompt=case.text, prompt_token_ids=x["input_ids"][0].tolist(), images=list(case.images),
                          videos=list(case.videos))
        for case, x in zip(cases, inputs)
    ]
    stops = stop_token_ids(bundle.model, bundle.eos_id)
    engine = VLLMEngine(str(tiny_model_dir(request.param)), bundle.adapter, dtype="float32", max_model_len=512,
                        limit_mm_per_prompt={"image": 2, "video": 1}, seed=0)
    try:
        result = engine.generate(requests, SamplingSettings(n=2, max_new_tokens=6, seed=5, stop_token_ids=tuple(stops)))
    finally:
        engine.close()
        del engine
        gc.collect()
    assert not result.skipped and len(result.outputs) == len(cases)
    kinds, prompts, responses, vision, engine_lp = [], [], [], [], []
    for out in result.outputs:
        x = inputs[out.request_index]
        for c in out.completions:
            kinds.append(cases[out.request_index].name)
            prompts.append(x["input_ids"][0].tolist())
            responses.append(c.token_ids)
            vision.append({k: v for k, v in x.items() if k not in NON_PROMPT_KEYS})
            engine_lp.append(torch.tensor(c.logprobs, dtype=torch.float32))
    assert sorted(set(kinds)) == sorted(KINDS)
    return Rollout(bundle, kinds, prompts, responses, vision, engine_lp, stops)


def _patched(adapter, rope_index):
    """A copy of ``adapter`` whose positions come from ``rope_index(adapter, *args, **kwargs)``."""

    class Patched(type(adapter)):
        def rope_index(self, *args, **kwargs):
            return rope_index(adapter, *args, **kwargs)

    return Patched(**asdict(adapter))


def _shifted(adapter, input_ids, mm_token_type_ids, *args, **kwargs):
    """The adapter's positions with every text token after the first vision token moved one further."""
    pos = adapter.rope_index(input_ids, mm_token_type_ids, *args, **kwargs)  # [3, B, S]
    after_vision = (mm_token_type_ids > 0).cumsum(-1) > 0  # [B, S]
    return pos + (after_vision & (mm_token_type_ids == 0)).long()[None]


def _library(model):
    """transformers' own rule (the model's ``get_rope_index``), as the actor used before."""

    def rope_index(adapter, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                   attention_mask=None, **extra):
        extra = {k: v for k, v in extra.items() if k in adapter.rope_video_keys and v is not None}
        return model.base_model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                               image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                               attention_mask=attention_mask, **extra)[0]

    return rope_index


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kind", KINDS)
def test_actor_matches_fp32_engine(rollout, layout, kind):
    diff = rollout.actor_diffs(layout)[kind]
    assert diff < TOLERANCE, (rollout.bundle.family, layout, kind, diff)


def test_shifted_positions_are_caught(rollout):
    """Control: one position of shift for the text after a vision item is far outside the tolerance."""
    shifted = rollout.diffs(_patched(rollout.bundle.adapter, _shifted), "padded")
    for kind in VISION_KINDS:
        assert shifted[kind] > CAUGHT, (rollout.bundle.family, kind, shifted[kind])
    assert shifted["text"] < TOLERANCE  # no vision item: nothing shifts


def test_transformers_rule_differs_only_for_video(rollout):
    """Control: transformers 5.19's rule agrees with the engine except for text after a video, where Qwen2-VL and
    Qwen2.5-VL are off (the Qwen3-VL processor, which Qwen3.5 and the MoE families share, places a video frame by
    frame, so their rule agrees everywhere)."""
    family = rollout.bundle.family
    library = rollout.diffs(_patched(rollout.bundle.adapter, _library(rollout.bundle.model)), "padded")
    for kind in KINDS:
        if family not in FRAME_BY_FRAME and kind in VIDEO_KINDS:
            assert library[kind] > CAUGHT, (family, kind, library[kind])
        else:
            assert library[kind] < TOLERANCE, (family, kind, library[kind])
