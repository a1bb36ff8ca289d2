"""What the rollout actors' maker leaves out where the Ray trainer actors score (and refuses to leave out), and the
KL the trainers record beside their reference's log-probs (which models go where: tests/models/test_where_ray_scores.py).
The equality of a whole Ray run with one process is tests/launch/test_ray_scoring.py."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.algorithms.kl import approx_kl
from mmrlhf.config import load_config
from mmrlhf.experience.batching import TrainItem
from mmrlhf.experience.rescoring import with_reference

TOY = "examples/grpo_toy_shapes_cpu.yaml"


def test_a_weightless_policy_has_the_loaded_ones_modules_and_no_memory():
    from mmrlhf.experience.builder import build_policy, weightless_policy
    from mmrlhf.testing.tiny_models import tiny_model_dir

    config = load_config(TOY, [f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}"])
    shapes, loaded = weightless_policy(config), build_policy(config, None, device=torch.device("cpu"))[0]
    assert {p.device.type for p in shapes.parameters()} == {"meta"}
    assert {n: p.shape for n, p in shapes.named_parameters()} == {n: p.shape for n, p in loaded.named_parameters()}
    assert shapes.model.generation_config.eos_token_id == loaded.model.generation_config.eos_token_id
    assert type(shapes.adapter) is type(loaded.adapter)


def _item(logp: list[float], mask: list[bool]) -> TrainItem:
    n = len(logp)
    return TrainItem(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), vision={}, vision_extra={},
                     token={"action_log_probs": torch.tensor(logp), "loss_mask": torch.tensor(mask)}, info={})


def test_with_reference_records_the_makers_kl_and_the_token_mean():
    items = [_item([-1.0, -2.0, -0.5], [True, True, False]), _item([-0.1, -3.0], [True, True])]
    policy = [it.token["action_log_probs"] for it in items]
    ref = [torch.tensor([-1.5, -1.0, -9.0]), torch.tensor([-0.1, -2.0])]
    out, metrics = with_reference(items, policy, ref, "k1")
    for it, lp, r in zip(out, policy, ref):
        assert torch.equal(it.token["base_action_log_probs"], r)
        want = approx_kl(lp[None], r[None], it.token["loss_mask"][None], "k1")[0]
        assert torch.equal(it.token["kl"], want)
    # k1 = logp - ref over the four masked tokens: 0.5, -1.0, 0.0, -1.0 (the masked-out third token is left out)
    assert metrics["kl/mean"] == pytest.approx((0.5 - 1.0 + 0.0 - 1.0) / 4)
    assert out[0].token["kl"][2] == 0  # off the mask


@pytest.mark.vllm
def test_a_maker_without_the_reference_refuses_a_kl_reward():
    pytest.importorskip("vllm")
    from mmrlhf.experience.builder import build_experience_maker
    from mmrlhf.testing.tiny_models import tiny_model_dir

    model = f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}"
    stack = build_experience_maker(load_config(TOY, [model, "algorithm.kl_loss_coef=0.05"]), device="cpu",
                                   score_reference=False)
    assert stack.reference is None and not stack.maker.settings.need_reference
    with pytest.raises(ValueError, match="kl_reward_coef"):
        build_experience_maker(load_config(TOY, [model, "algorithm.kl_reward_coef=0.05"]), device="cpu",
                               score_reference=False)
