"""Config tree -> FastExperienceMaker: the sections are consumed, not just parsed."""

from __future__ import annotations

import pytest
from PIL import Image

from mmrlhf.config import build_config
from mmrlhf.experience.builder import build_experience_maker
from mmrlhf.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


def test_builder_wires_a_working_maker_from_config():
    cfg = build_config({
        "model": {"pretrain": str(tiny_model_dir("qwen2_5_vl")), "dtype": "float32"},
        "data": {"prompt_max_len": 256},
        "rollout": {"engine": "vllm", "n_samples_per_prompt": 2, "max_new_tokens": 8, "max_model_len": 512,
                    "micro_rollout_batch_size": 3, "seed": 4},
        "reward": {"label_map": {"colour": {"type": "function", "function": "exact_match"}},
                   "recipe": {"colour": [["colour", 1.0]]}},
        "algorithm": {"advantage_estimator": "rloo", "kl_reward_coef": 0.02, "kl_controller": "adaptive",
                      "high_entropy_top_p": 0.2},
        "trainer": {"packing_samples": True},
    })
    stack = build_experience_maker(cfg, device="cpu")
    maker = stack.maker
    assert maker.settings.packing and maker.settings.need_reference and maker.settings.compute_entropy
    assert maker.settings.advantage_estimator == "rloo" and maker.kl_controller.value == 0.02
    img = Image.new("RGB", (56, 56), (255, 0, 0))
    exps = maker.make_experience_list(["<image>What color is the square?", "Name a colour."], images=[[img], None],
                                      references=["red", "blue"], labels=["colour", "colour"])
    assert [e.sequences.shape[0] for e in exps] == [1, 1]  # two packed micro-batches (3 + 1 samples), each [1, T]
    assert sum(len(e.packed_seq_lens) for e in exps) == 4
    assert all(e.action_entropy is not None and e.base_action_log_probs is not None for e in exps)
    assert "reward/colour/mean" in exps[0].info["batch"]
    assert maker.kl_controller.value != 0.02  # the adaptive controller moved after the batch


def test_builder_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="model.pretrain"):
        build_experience_maker(build_config({}))
