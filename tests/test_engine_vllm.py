"""The real vLLM engine (CPU build here, serving bf16 as on a GPU) on each tiny family (Qwen3-VL with tied
embeddings): generation with text, one image, two images and a video at temperature 0.7; the log-probs of the
sampled distribution agree with a float32 transformers forward of the same distribution; a layout error is caught
by the check."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.adapters import get_adapter
from mmrlhf.testing.engine_check import DEFAULT_TOLERANCE, default_cases, hf_response_logprobs, run_engine_check
from mmrlhf.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


@pytest.mark.parametrize("family, tied", [("qwen2_vl", False), ("qwen2_5_vl", False), ("qwen3_vl", True)])
def test_vllm_matches_transformers_logprobs(family, tied):
    path = str(tiny_model_dir(family, tied=tied))
    report = run_engine_check(path, samples_per_prompt=3, max_new_tokens=24, seed=7, temperature=0.7,
                              dtype="bfloat16")
    adapter = get_adapter(path)
    names = [c.name for c in report["cases"]]
    assert names == ["text", "one_image", "two_images", "video"]
    for case in report["cases"]:
        assert len(case.response_ids) == 3
        for ids, lp_engine, lp_hf in zip(case.response_ids, case.engine_logprobs, case.hf_logprobs):
            assert 1 <= len(ids) <= 24
            assert not set(ids) & set(adapter.vision_special_token_ids())  # forbidden in generation
            assert lp_engine.shape == lp_hf.shape == (len(ids),)
            assert torch.all(lp_engine <= 0)
        # Tolerances documented in docs/environment.md (bf16 engine vs fp32 forward; measured <= ~0.005 max).
        assert case.max_abs_diff < DEFAULT_TOLERANCE, (family, case.name, case.max_abs_diff)

    # Negative control: score the two-image samples with the images swapped (a different token layout, as a
    # vision-bookkeeping bug would produce). The check must see it.
    case = next(c for c in default_cases(AutoProcessor.from_pretrained(path)) if c.name == "two_images")
    case.images = case.images[::-1]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    result = next(c for c in report["cases"] if c.name == "two_images")
    wrong = hf_response_logprobs(model, AutoProcessor.from_pretrained(path), case, result.response_ids,
                                 temperature=0.7, forbidden=adapter.vision_special_token_ids())
    worst = max(float((a - b).abs().max()) for a, b in zip(result.engine_logprobs, wrong))
    assert worst > DEFAULT_TOLERANCE and worst > 5 * result.max_abs_diff, (worst, result.max_abs_diff)
    del report
    gc.collect()


def test_mismatched_image_video_normalisation_is_handled(tmp_path):
    """vLLM normalises pixels on the device with one mean/std for some families; a checkpoint whose image and
    video processors normalise differently must still give matching video log-probs (make_llm then normalises on
    the host). Control: with device normalisation forced on, the same video disagrees."""
    import json

    import vllm

    from mmrlhf.rollout.vllm_setup import processors_normalise_alike
    from mmrlhf.testing.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "q3", "qwen3_vl", "tiny", seed=0)
    assert processors_normalise_alike(str(path))
    cfg_file = path / "processor_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["image_processor"]["image_mean"] = [0.48145466, 0.4578275, 0.40821073]
    cfg["image_processor"]["image_std"] = [0.26862954, 0.26130258, 0.27577711]
    cfg_file.write_text(json.dumps(cfg))
    assert not processors_normalise_alike(str(path))
    video_only = [c for c in default_cases(AutoProcessor.from_pretrained(path)) if c.name == "video"]
    handled = run_engine_check(str(path), cases=video_only, samples_per_prompt=3, max_new_tokens=24, seed=1,
                               dtype="bfloat16")
    assert handled["cases"][0].max_abs_diff < DEFAULT_TOLERANCE
    del handled
    gc.collect()
    forced = vllm.LLM(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=2048, seed=0,
                      limit_mm_per_prompt={"image": 1, "video": 1}, mm_device_do_normalize=True,
                      logprobs_mode="processed_logprobs")
    control = run_engine_check(str(path), cases=video_only, samples_per_prompt=3, max_new_tokens=24, seed=1,
                               llm=forced)
    assert control["cases"][0].max_abs_diff > DEFAULT_TOLERANCE
