"""Where the Ray mode keeps each model (``mmrlhf.models.ray_placement``): which models the trainer actors score
under ``distributed.scoring`` auto and trainer, and what each rollout actor then holds beside its engine (what the
memory plan counts on its GPU and ``ray/rollout_scoring_models`` reports)."""

from __future__ import annotations

import pytest

from mmrlhf.config import load_config
from mmrlhf.models.ray_placement import (experiences_on_trainers, policy_on_trainers, policy_scoring_blockers,
                                         reference_on_trainers, rollout_actor_models, teacher_on_trainers)

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


@pytest.mark.parametrize("overrides, made_there", [
    (["algorithm.kl_reward_coef=0.01"], True),
    (["algorithm.advantage_estimator=gae", "algorithm.kl_loss_coef=0.05"], True),
    (["model.teacher=/somewhere", "algorithm.distill_coef=0.5"], True),
    (["rollout.top_p=0.9"], True),
    (["rollout.routing_replay=replay"], True),
    (["agent.tools=[calculator]"], True),
    ([], False),  # nothing reads the old policy there: the rollout actors make them, the trainers re-score
    (["algorithm.kl_loss_coef=0.05"], False),
    (["algorithm.kl_reward_coef=0.01", "model.lora.rank=4"], False),  # the copy merges the adapters
    (["algorithm.kl_reward_coef=0.01", "rollout.engine=transformers"], False),  # it generates with the module
    (["algorithm.kl_reward_coef=0.01", "distributed.scoring=rollout"], False),
])
def test_auto_makes_the_experiences_on_the_trainers_where_the_rollout_side_reads_the_old_policy(overrides,
                                                                                                  made_there):
    config = load_config(TOY, overrides)
    assert experiences_on_trainers(config) is made_there
    if made_there:  # its maker holds the reference and the teacher, and no rollout actor scores anything
        assert not reference_on_trainers(config) and not teacher_on_trainers(config)
        assert rollout_actor_models(config) == () and not policy_on_trainers(config)
    else:
        assert policy_on_trainers(config) is (not policy_scoring_blockers(config)
                                              and "distributed.scoring=rollout" not in overrides)


@pytest.mark.parametrize("overrides, held", [
    ([], ()),  # GRPO: the trainer actors re-score the old policy
    (["algorithm.kl_loss_coef=0.05"], ()),  # and the KL loss's reference
    (["algorithm.kl_reward_coef=0.01"], ()),  # the shaping reads the old policy: the trainers make the experiences
    (["algorithm.advantage_estimator=gae"], ()),
    (["model.teacher=/somewhere", "algorithm.distill_coef=0.5"], ()),
    (["algorithm.kl_reward_coef=0.01", "model.lora.rank=4"], ("policy",)),  # the reference: its adapters off
    (["algorithm.kl_reward_coef=0.01", "model.lora.rank=4", "model.reference=/elsewhere"], ("policy", "reference")),
    (["model.lora.rank=4", "algorithm.advantage_estimator=gae"], ("policy", "critic")),
    (["model.lora.rank=4", "model.teacher=/somewhere", "algorithm.distill_coef=0.5"], ("policy", "teacher")),
    (["distributed.scoring=rollout", "algorithm.kl_reward_coef=0.01"], ("policy", "reference")),
    (["distributed.scoring=rollout", "algorithm.advantage_estimator=gae"], ("policy", "critic")),
    (["model.teacher=/somewhere", "algorithm.distill_loss_coef=0.1"], ()),
    (["rollout.engine=transformers"], ("policy",)),  # (its engine's own module: the plan counts it once)
    (["distributed.scoring=rollout"], ("policy",)),
    (["distributed.scoring=rollout", "algorithm.kl_loss_coef=0.05"], ("policy",)),  # the KL loss's: the trainers'
    (["distributed.scoring=trainer", "algorithm.kl_reward_coef=0.01", "algorithm.advantage_estimator=gae",
      "model.teacher=/somewhere", "algorithm.distill_coef=0.5"], ()),
])
def test_what_a_rollout_actor_holds_beside_its_engine(overrides, held):
    assert rollout_actor_models(load_config(TOY, overrides)) == held
