"""Which models the Ray trainer actors score (``reference_on_trainers`` / ``teacher_on_trainers``), what the
rollout actors' maker then leaves out (and refuses to leave out), and the KL the trainers record beside their
reference's log-probs. The equality of a whole Ray run with one process is tests/launch/test_ray_scoring.py."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.algorithms.kl import approx_kl
from mmrlhf.config import load_config
from mmrlhf.experience.batching import TrainItem
from mmrlhf.experience.rescoring import (policy_on_trainers, policy_scoring_blockers, reference_on_trainers,
                                         teacher_on_trainers, with_reference)

TOY = "examples/grpo_toy_shapes_cpu.yaml"


@pytest.mark.parametrize("overrides, reference, teacher", [
    (["algorithm.kl_loss_coef=0.05"], True, False),
    (["algorithm.kl_loss_coef=0.05", "algorithm.kl_reward_coef=0.01"], False, False),  # the shaping reads it
    (["algorithm.kl_loss_coef=0.05", "model.lora.rank=4"], False, False),  # the policy with its adapters off
    (["algorithm.kl_reward_coef=0.01"], False, False),
    ([], False, False),
    (["model.teacher=/somewhere", "algorithm.distill_loss_coef=0.1"], False, True),
    (["model.teacher=/somewhere", "algorithm.distill_loss_coef=0.1", "algorithm.distill_coef=0.5"], False, False),
    (["model.teacher=/somewhere", "algorithm.distill_coef=0.5"], False, False),
])
def test_what_the_trainer_actors_score(overrides, reference, teacher):
    config = load_config(TOY, overrides)
    assert reference_on_trainers(config) is reference
    assert teacher_on_trainers(config) is teacher


@pytest.mark.parametrize("overrides, trainers", [
    ([], True),  # GRPO: rewards, groups and masks only on the rollout side
    (["algorithm.kl_loss_coef=0.05"], True),  # its reference moves to the trainers too
    (["algorithm.dynamic_sampling=true", "algorithm.advantage_whitening=batch", "algorithm.high_entropy_top_p=0.5",
      "algorithm.reward_normalization=true"], True),  # rewards and masks; the entropies are the trainers' own
    (["distributed.scoring=rollout"], False),
    (["algorithm.kl_reward_coef=0.01"], False),
    (["algorithm.kl_loss_coef=0.05", "model.lora.rank=4"], False),
    (["algorithm.advantage_estimator=gae"], False),
    (["model.teacher=/somewhere", "algorithm.distill_coef=0.5"], False),
    (["rollout.top_p=0.9"], False),  # the shaping's mask drops the copy's outside tokens
    (["rollout.top_p=0.9", "rollout.logprob_mode=full"], True),
    (["rollout.engine=transformers"], False),
    (["rollout.routing_replay=replay"], False),
])
def test_where_the_old_policy_is_scored(overrides, trainers):
    config = load_config(TOY, overrides)
    assert policy_on_trainers(config) is trainers
    assert bool(policy_scoring_blockers(config)) is (not trainers and "distributed.scoring=rollout" not in overrides)


def test_trainer_scoring_makes_the_experiences_on_the_trainers_in_every_configuration():
    from mmrlhf.experience.rescoring import experiences_on_trainers, reference_on_trainers, teacher_on_trainers

    # every setting that keeps a scoring copy on the rollout actors under "auto" is served by the trainers' maker
    for blocked in (["algorithm.kl_reward_coef=0.01"], ["algorithm.advantage_estimator=gae"], ["rollout.top_p=0.9"],
                    ["model.lora.rank=4"], ["rollout.engine=transformers"]):
        config = load_config(TOY, ["distributed.scoring=trainer", *blocked])
        assert policy_scoring_blockers(config) and experiences_on_trainers(config), blocked
        assert not policy_on_trainers(config)  # (the re-scoring of rollout-made experiences is "auto"'s)
    kl_loss = load_config(TOY, ["distributed.scoring=trainer", "algorithm.kl_loss_coef=0.05",
                                "model.teacher=/somewhere", "algorithm.distill_loss_coef=0.1"])
    assert not reference_on_trainers(kl_loss) and not teacher_on_trainers(kl_loss)  # the maker holds them
    assert reference_on_trainers(load_config(TOY, ["algorithm.kl_loss_coef=0.05"]))  # the control: "auto"
    assert not experiences_on_trainers(load_config(TOY, []))
    from mmrlhf.trainer.preflight import check_before_models

    refused = ["distributed.scoring=trainer", "model.lora.rank=4", "model.lora.sync=vllm_lora"]
    check_before_models(load_config(TOY, refused))  # (outside the Ray mode the key is not read)
    with pytest.raises(ValueError, match=r"distributed.scoring=trainer.*model.lora.sync=merged"):  # the driver's
        check_before_models(load_config(TOY, [*refused, "distributed.backend=ray"]))


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
