"""On-policy distillation through the experience maker: the teacher is built from ``model.teacher``, scores the
student's samples (images included) in the scoring forwards, and its advantage reaches the experiences."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from mmrlhf.config import build_config
from mmrlhf.experience.builder import build_experience_maker, build_teacher
from mmrlhf.models.adapters import get_adapter
from mmrlhf.testing.tiny_models import tiny_model_dir


def _config(student, teacher, trainer=None, **algorithm):
    return build_config({
        "trainer": trainer or {},
        "model": {"pretrain": str(student), "teacher": str(teacher), "dtype": "float32"},
        "data": {"prompt_max_len": 256},
        "rollout": {"engine": "transformers", "n_samples_per_prompt": 2, "max_new_tokens": 4, "max_model_len": 512,
                    "micro_rollout_batch_size": 3, "seed": 4},
        "reward": {"label_map": {"colour": {"type": "function", "function": "exact_match"}},
                   "recipe": {"colour": [["colour", 1.0]]}},
        "algorithm": {"advantage_estimator": "distill", "distill_coef": 1.0, **algorithm},
    })


def _experiences(cfg):
    stack = build_experience_maker(cfg, device="cpu")
    img = Image.new("RGB", (56, 56), (255, 0, 0))
    exps = stack.maker.make_experience_list(["<image>What color is the square?", "Name a colour."],
                                            images=[[img], None], references=["red", "blue"],
                                            labels=["colour", "colour"])
    return stack, exps


def _uniform_teacher(tmp_path):
    """A copy of the tiny student whose head is zero: every logit 0, so it scores each allowed token
    -log(number of allowed tokens), whatever the context."""
    src = tiny_model_dir("qwen2_vl")
    dst = tmp_path / "uniform_teacher"
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_teacher_equal_to_the_student_gives_zero_advantage():
    student = tiny_model_dir("qwen2_vl")
    stack, exps = _experiences(_config(student, student))
    assert stack.teacher is not None and stack.teacher is not stack.actor
    for e in exps:
        assert e.action_mask.any()
        torch.testing.assert_close(e.advantages, torch.zeros_like(e.advantages), rtol=0, atol=1e-5)
    assert abs(exps[0].info["batch"]["distill/reverse_kl"]) < 1e-5


@pytest.mark.parametrize("layout", [{"shared_prompt": False}, {"packing_samples": True, "shared_prompt": False},
                                    {"shared_prompt": True}],
                         ids=["padded", "packed", "shared_prompt"])
def test_a_different_teacher_gives_its_log_ratio_with_the_expected_sign(tmp_path, layout):
    """Whatever layout the scoring forwards use, the teacher scores the same tokens as the student."""
    teacher = _uniform_teacher(tmp_path)
    stack, exps = _experiences(_config(tiny_model_dir("qwen2_vl"), teacher, layout))
    assert stack.maker.settings.packing == bool(layout.get("packing_samples"))
    assert stack.maker.settings.shared_prompt == layout["shared_prompt"]
    allowed = stack.teacher.model.get_output_embeddings().weight.shape[0] - len(stack.teacher.excluded_token_ids)
    uniform = -math.log(allowed)
    signs = set()
    for e in exps:  # image and text prompts alike
        m = e.action_mask
        want = (uniform - e.action_log_probs) * m  # the oracle: teacher minus student, per token
        torch.testing.assert_close(e.advantages, want, rtol=0, atol=1e-4)
        # teacher more likely than the student -> positive; less likely -> negative
        more = (uniform > e.action_log_probs) & m
        assert (e.advantages[more] > 0).all() and (e.advantages[m & ~more] < 0).all()
        signs |= {bool(x) for x in more[m]}
    assert signs == {True, False}  # both cases occurred in the batch


def test_mixed_with_grpo_adds_the_term_and_logs_it(tmp_path):
    teacher = _uniform_teacher(tmp_path)
    student = tiny_model_dir("qwen2_vl")
    cfg = _config(student, teacher, advantage_estimator="grpo", distill_coef=0.5)
    stack, exps = _experiences(cfg)
    info = exps[0].info["batch"]
    assert "distill/reverse_kl" in info and "time/teacher" in info
    assert stack.maker.settings.distill_coef == 0.5


def test_the_teacher_must_be_of_the_students_family():
    cfg = _config(tiny_model_dir("qwen2_vl"), tiny_model_dir("qwen2_5_vl"))
    with pytest.raises(ValueError, match="same family"):
        build_teacher(cfg, get_adapter(str(tiny_model_dir("qwen2_vl"))), torch.device("cpu"))
