"""``distributed.scoring: trainer``: the Ray rollout actors generate and reward only, and the trainer actors make the
experiences (:func:`~mmrlhf.models.ray_placement.experiences_on_trainers`), in the configurations whose rollout
actors kept a float32 copy of the policy under ``auto``: a critic (GAE), a KL term in the reward with an adaptive
coefficient, reward normalisation (both running state, now the trainers'), the distillation advantage and a
truncating sampler scored as sampled.

Two trainer actors (one FSDP2 group, gloo) make the experiences of the rows rollout actor sends, the policy,
critic, reference and teacher sharded; every metric and the policy's update of 2 steps match one process within
the reduction noise of two ranks (as tests/launch/test_one_loop.py bounds it), and the rollout actor held no model
beside its engine (``ray/rollout_scoring_models`` 0). The reference and the teacher are other models than the
policy (the tiny model of other seeds), so the reward's KL term and the distillation advantage are large from the
first step. On the code before, the key was refused here (``distributed.scoring=trainer``: the rollout actors must
score the old policy)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ray  # noqa: E402  (requirements/project.txt installs it; a missing ray must fail, not skip)

from launch_testing import metric_rows, tiny_update, training_gaps

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
LR = 3.0e-4  # examples/grpo_toy_shapes_cpu.yaml
# Sums of O(1) terms near 0 (as tests/launch/test_one_loop.py scales them); and the critic's mean value, a mean of
# predictions of O(1) returns that starts at 0 (with LoRA's reference, the base, the KL term is float noise of
# ~1e-7 per token at the second step, and the critic's first step moves its mean value to ~1e-4 only)
TERM_SCALE = {"policy/pg_loss": 1.0, "policy/approx_kl": 1.0, "advantage_mean": 1.0, "kl/mean": 1.0, "kl": 1.0,
              "kl_seq": 1.0, "critic/vf_mean": 1.0}
# clocks, what only one mode has, and each rank's own micro-batch split (the forwards' tokens follow the ranks)
SKIP = ("time/", "sync/", "throughput/", "async/", "engine_logprob_diff/", "rollout_is/abs_log_ratio", "ledger/",
        "policy/micro_batch", "policy/oversized_micro_batches", "critic/micro_batch", "critic/oversized_micro_batches",
        "scoring/micro_batch", "ray/", "logprobs/")


# LoRA: the rollout actor holds no adapted copy to merge from, so the trainer actors send the merged layers
# (W + BA, gathered from their shards); the reference is then the policy with its adapters off, held by the trainers
LORA = ("model.lora.rank=4", "model.reference=", "model.teacher=", "algorithm.distill_coef=0")


def _config(out: Path, *overrides: str):
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}",
        f"model.reference={tiny_model_dir('qwen2_vl', 'tiny', 1)}",
        f"model.teacher={tiny_model_dir('qwen2_vl', 'tiny', 2)}", "algorithm.distill_coef=0.5",
        "algorithm.advantage_estimator=gae", "algorithm.kl_reward_coef=0.05", "algorithm.kl_controller=adaptive",
        "algorithm.kl_target=0.001", "algorithm.kl_horizon=1000", "algorithm.reward_normalization=true",
        "rollout.top_p=0.95",
        f"trainer.output_dir={out}", f"trainer.max_steps={STEPS}", "trainer.eval_steps=0", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "trainer.report_steps=0", "trainer.save_steps=1000",
        "trainer.rollout_batch_size=4", "trainer.train_batch_size=64", "trainer.micro_train_batch_size=64",
        # rewards that vary inside the groups: the policy-gradient term moves the weights from the first step
        "reward.label_map={first_word: {type: function, function: 'mmrlhf.testing.rewards:response_length_reward'}}",
        *overrides])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mmrlhf.launch import run
    from mmrlhf.launch.ray.driver import run_ray

    out = {name: tmp_path_factory.mktemp(name) for name in ("single", "ray2", "single_lora", "ray2_lora")}
    assert run(_config(out["single"])) == 0
    assert run(_config(out["single_lora"], *LORA)) == 0
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name, extra in (("ray2", ()), ("ray2_lora", LORA)):
            assert run_ray(_config(out[name], "distributed.backend=ray", "distributed.scoring=trainer",
                                   "distributed.num_trainer_actors=2", "distributed.trainer_actor_cpus=0.5",
                                   "distributed.rollout_actor_cpus=1", *extra)) == 0
    finally:
        ray.shutdown()
    return out


@pytest.mark.parametrize("case", ["full", "lora"])
def test_the_trainer_actors_make_the_experiences_as_one_process_does(runs, case):
    pair = (runs["single"], runs["ray2"]) if case == "full" else (runs["single_lora"], runs["ray2_lora"])
    single, two = (metric_rows(out) for out in pair)
    assert len(single) == len(two) == STEPS
    assert all(r["ray/rollout_scoring_models"] == 0 for r in two), [r["ray/rollout_scoring_models"] for r in two]
    # the engine sampled with the trainer's weights (the fresh samples' log-probs, engine vs trainer actors)
    assert all(r["engine_logprob_diff/trainer_max"] < 1e-4 for r in two), [r["engine_logprob_diff/trainer_max"]
                                                                         for r in two]
    if case == "full":  # another reference and teacher than the policy: a large KL and distillation signal at once
        assert single[0]["kl/mean"] > 0.01 and two[0]["kl/mean"] > 0.01, (single[0]["kl/mean"], two[0]["kl/mean"])
    else:  # the adapters moved the policy off its base (the reference) by the second step
        assert single[1]["kl/mean"] > 1e-4 and two[1]["kl/mean"] > 1e-4, (single[1]["kl/mean"], two[1]["kl/mean"])
    gaps = training_gaps(single, two, skip=SKIP, term_scale=TERM_SCALE)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    print(f"\nRay trainer-made experiences vs one process, largest gaps: {worst}")
    # the critic's values and update, the reward's KL term and its adaptive coefficient, the running reward
    # normalisation, the distillation advantage and the old policy's entropy are among the compared metrics
    assert {"critic/vf_mean", "critic/vf_loss", "critic/grad_norm", "kl/mean", "kl_coef", "reward_running_std",
            "reward/shaped_mean", "policy/grad_norm", "policy/entropy", "policy/approx_kl", "policy/pg_loss",
            *(["distill/reverse_kl"] if case == "full" else [])} <= set(gaps), sorted(gaps)
    assert max(gaps.values()) <= 1e-4, worst
    if case == "lora":  # the adapters' merged layers, not the whole policy: the untouched tensors (embeddings,
        # norms, every layer without an adapter) stay (here 1.1 of 2.1 MB travel)
        full = metric_rows(runs["ray2"])[0]["sync/megabytes"]
        assert 0 < two[0]["sync/megabytes"] < 0.8 * full, (two[0]["sync/megabytes"], full)
        return  # (the checkpoint's model is the base; the adapter's update is compared through the metrics)
    a, b = (tiny_update(out, STEPS) for out in pair)
    gap = max(float((a[k] - b[k]).abs().max()) for k in a) / LR
    moved = max(float(a[k].abs().max()) for k in a) / LR
    print(f"update gap {gap:.3f} lr (largest update {moved:.2f} lr)")
    assert gap < 0.2
    assert moved > 1.0, moved  # the control: 2 AdamW steps move weights by ~lr each, so equal updates are not 0 = 0
