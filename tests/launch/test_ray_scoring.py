"""The Ray mode's old-policy log-probs, KL-loss reference and distillation-loss teacher are scored by the trainer
actors, sharded with the policy, and give one process's training.

Nothing on the rollout side reads the old-policy log-probs here (GRPO, no KL term in the reward, no critic, an
untruncated sampler: :func:`~mmrlhf.models.ray_placement.policy_on_trainers`), so the rollout actor holds no
scoring copy of the policy (its actor's parameters are on the meta device) and reports no ``actor`` phase; the
trainer actors compute the old log-probs and entropies before the update (max_staleness 0: their weights are the
behaviour policy's).

With ``algorithm.kl_loss_coef > 0`` and no KL term in the reward, and ``distill_loss_coef > 0`` without the
distillation advantage, nothing a rollout actor computes reads the reference or the teacher, so the rollout actors
hold neither (their maker's phases have no ``reference`` or ``teacher`` time) and the trainer actors (one FSDP2
group of two, gloo) score both beside their re-scoring of the policy (:mod:`mmrlhf.experience.rescoring`). Both are
other models than the policy (the tiny model of other seeds), so the KL and the distillation loss are large from the
first step, where models equal to the policy would give ~0. Every metric (the KL to the reference, the KL and
distillation losses, the old policy's entropy, the gradient norm) and the weight updates of 2 steps match one
process within the reduction noise of two trainer actors (as tests/launch/test_one_loop.py bounds it). On the code
before, the rollout actor reported the actor (policy), reference and teacher phases."""

from __future__ import annotations

from pathlib import Path

import pytest

import ray  # noqa: E402  (requirements/project.txt installs it; a missing ray must fail, not skip)

from launch_testing import metric_rows, tiny_update, training_gaps

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
LR = 3.0e-4  # examples/grpo_toy_shapes_cpu.yaml
TERM_SCALE = {"policy/pg_loss": 1.0, "policy/approx_kl": 1.0, "advantage_mean": 1.0}  # sums of O(1) terms near 0
SKIP = ("time/", "sync/", "throughput/", "async/", "engine_logprob_diff/", "rollout_is/abs_log_ratio", "ledger/",
        "policy/micro_batch", "policy/oversized_micro_batches", "ray/", "logprobs/")


def _config(out: Path, *overrides: str):
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}",
        f"model.reference={tiny_model_dir('qwen2_vl', 'tiny', 1)}", "algorithm.kl_loss_coef=0.05",
        f"model.teacher={tiny_model_dir('qwen2_vl', 'tiny', 2)}", "algorithm.distill_loss_coef=0.1",
        "algorithm.distill_topk=4", f"trainer.output_dir={out}", f"trainer.max_steps={STEPS}",
        "trainer.eval_steps=0", "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.report_steps=0",
        "trainer.save_steps=1000", "trainer.rollout_batch_size=4", "trainer.train_batch_size=64",
        "trainer.micro_train_batch_size=64",
        # rewards that vary inside the groups: the policy-gradient term, where the old log-probs enter, moves the
        # weights from the first step (the toy's colour reward is 0 for the untrained tiny model)
        "reward.label_map={first_word: {type: function, function: 'mmrlhf.testing.rewards:response_length_reward'}}",
        *overrides])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mmrlhf.launch import run
    from mmrlhf.launch.ray.driver import run_ray

    single, two = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("ray2")
    assert run(_config(single)) == 0
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert run_ray(_config(two, "distributed.backend=ray", "distributed.num_trainer_actors=2",
                               "distributed.trainer_actor_cpus=0.5", "distributed.rollout_actor_cpus=1")) == 0
    finally:
        ray.shutdown()
    return single, two


def test_the_trainer_actors_score_the_reference_and_the_teacher_as_one_process_does(runs):
    single, two = (metric_rows(out) for out in runs)
    assert len(single) == len(two) == STEPS
    # where the policy, the reference and the teacher were scored: in one process's maker; in the Ray run not on
    # the rollout actor (no policy forward there, so no copy of it to compare with its engine either: its
    # engine_logprob_diff/mean|max; the trainer actors' check of the engine against their own policy stands)
    for phase in ("time/actor", "time/reference", "time/teacher", "engine_logprob_diff/max"):
        assert all(phase in r for r in single) and not any(phase in r for r in two), phase
    assert all(r["ray/rollout_scoring_models"] == 0 for r in two), [r["ray/rollout_scoring_models"] for r in two]
    assert all(r["engine_logprob_diff/trainer_max"] < 1e-4 for r in two), [r["engine_logprob_diff/trainer_max"]
                                                                         for r in two]
    # the teacher is another model too: its loss term is not that of a teacher equal to the student (~0)
    assert single[0]["policy/distill_loss"] > 1e-3, single[0]["policy/distill_loss"]
    # a reference other than the policy: a large KL from the first step (a reference equal to it would give 0)
    assert single[0]["kl/mean"] > 0.01 and two[0]["kl/mean"] > 0.01, (single[0]["kl/mean"], two[0]["kl/mean"])
    gaps = training_gaps(single, two, skip=SKIP, term_scale=TERM_SCALE)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    print(f"\nRay trainer-scored reference and teacher vs one process, largest gaps: {worst}")
    # the old policy's entropy (the items' action_entropy, from the trainer actors' forward in the Ray run) and the
    # PPO ratio's terms (its old log-probs) are among the compared metrics
    assert {"kl/mean", "policy/kl_loss", "policy/distill_loss", "policy/grad_norm", "reward/mean", "policy/entropy",
            "policy/approx_kl", "policy/pg_loss"} <= set(gaps), sorted(gaps)
    assert gaps["kl/mean"] <= 1e-5 and gaps["policy/kl_loss"] <= 1e-4 and gaps["policy/distill_loss"] <= 1e-4, gaps
    assert max(gaps.values()) <= 1e-4, gaps
    a, b = (tiny_update(out, STEPS) for out in runs)
    gap = max(float((a[k] - b[k]).abs().max()) for k in a) / LR
    moved = max(float(a[k].abs().max()) for k in a) / LR
    print(f"update gap {gap:.3f} lr (largest update {moved:.2f} lr)")
    assert gap < 0.2
    assert moved > 1.0, moved  # the control: 2 AdamW steps move weights by ~lr each, so equal updates are not 0 = 0
