"""One training loop for every launch mode: the same recipe, seed and total batch trains the same in one process,
under torchrun with one rank and in the Ray mode with one rollout actor and one trainer actor (metrics and weights);
two Ray trainer actors (one FSDP2 group over gloo) equal one process within fp32 reduction noise; a Ray run resumed
from a checkpoint of the straight run (``max_staleness`` 0 and 1) continues exactly as the straight run. The
control, a Ray run whose rollout actor never receives the new weights, must differ. Every run has the keys that
carry from step to step on the rollout side (``STATEFUL``: reward normalisation, the adaptive KL coefficient,
dynamic sampling's stream, with batch advantage whitening), so these train in every mode as in one process and
resume exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ray  # noqa: E402  (requirements/project.txt installs it; a missing ray must fail, not skip)

from launch_testing import stopped_at

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
LR = 3.0e-4  # examples/grpo_toy_shapes_cpu.yaml
# Metrics compared at rel 1e-5 of their scale. GRPO's policy loss is a mean of advantage x ratio terms whose sum is
# ~0 (advantages are centred per group): its scale is the terms' (|A| ~ 1), not its own value (~1e-9). The approximate
# KL, the KL loss and the KL to the reference are means of differences of log-probs (O(1) each) that are equal up to
# summation noise; so are the engine-vs-trainer differences (``engine_logprob_diff/*``: float noise, ~1e-7, of O(1)
# log-probs; relative to themselves, noise compared with noise). The mean of GRPO's advantages (before whitening) is
# ~0 for the same reason as the policy loss: its terms are O(1).
TERM_SCALE = {"policy/pg_loss": 1.0, "policy/approx_kl": 1.0, "policy/kl_loss": 1.0, "kl": 1.0, "kl/mean": 1.0,
              "kl_seq": 1.0, "advantage_mean": 1.0}
TERM_SCALE_PREFIXES = ("engine_logprob_diff/",)


def _scale(key: str, pairs: list[tuple[float, float]]) -> float:
    """What a metric's gap is relative to: its terms' scale (above), else its largest |value| over both runs."""
    if key in TERM_SCALE:
        return TERM_SCALE[key]
    if key.startswith(TERM_SCALE_PREFIXES):
        return 1.0
    return max(max(abs(u), abs(v)) for u, v in pairs) or 1.0
# Left out of the comparison: clocks, the engine's own numerics (vLLM in another process), what only one mode has,
# and the update's micro-batch split (each rank's own forwards: it follows the number of ranks).
SKIP = ("time/", "sync/", "throughput/", "async/", "engine_logprob_diff/", "rollout_is/abs_log_ratio", "ledger/",
        "policy/micro_batch", "policy/oversized_micro_batches")


# What carries from step to step on the rollout side, in every run of this module: a reward normaliser and an
# adaptive KL coefficient that moves every step (a horizon of 4 steps of 128 samples: a few % per step, up or down),
# advantage whitening (a batch statistic) and dynamic sampling, whose rounds read the stream and the sampling calls
# on from where the last step stopped.
STATEFUL = ("algorithm.reward_normalization=true", "algorithm.kl_controller=adaptive", "algorithm.kl_reward_coef=0.05",
            "algorithm.kl_target=0.001", "algorithm.kl_horizon=1000", "algorithm.advantage_whitening=batch",
            "algorithm.dynamic_sampling=true")
# Half the recipe's batch (8 prompts x 16 samples), in every run too: what these runs compare does not depend on its
# size, and each of the module's 11 runs costs less.
HALF_BATCH = ("trainer.rollout_batch_size=8", "trainer.train_batch_size=128", "trainer.micro_train_batch_size=128")


def _config(out: Path, *overrides: str):
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}", f"trainer.output_dir={out}",
        f"trainer.max_steps={STEPS}", "trainer.eval_steps=0", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "trainer.report_steps=0", "trainer.save_steps=1000", *STATEFUL, *HALF_BATCH,
        *overrides])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _weights(out: Path, step: int = STEPS) -> dict:
    from safetensors.torch import load_file

    return load_file(str(next((out / "checkpoints" / f"step-{step:08d}" / "model").glob("*.safetensors"))))


def _initial() -> dict:
    from safetensors.torch import load_file

    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_file(str(next(Path(tiny_model_dir("qwen2_vl", "tiny", 0)).glob("*.safetensors"))))


def metric_gaps(a: list[dict], b: list[dict]) -> dict[str, float]:
    """Per metric, the largest |a - b| over the steps, relative to the metric's scale (its largest |value| over
    both runs, or its terms' scale)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    keys = {k for r in a for k in r} & {k for r in b for k in r}
    gaps = {}
    for k in sorted(keys):
        if k == "step" or k.startswith(SKIP):
            continue
        pairs = [(x[k], y[k]) for x, y in zip(a, b) if k in x and k in y]
        gaps[k] = max(abs(u - v) for u, v in pairs) / _scale(k, pairs)
    return gaps


# A resume compares every metric with the straight run's but these: wall-clock readings (durations, waits, shares of
# the wall time, rates per second) differ between any two runs whatever the training does.
CLOCKS = ("time/", "throughput/", "sync/seconds", "async/generate_s", "async/trainer_wait_s", "async/rollout_wait_s",
          "async/trainer_wait_share", "async/rollout_wait_share")


def every_metric_gaps(a: list[dict], b: list[dict]) -> dict[str, float]:
    """Per metric but the clocks, the largest |a - b| over the steps relative to its scale, as :func:`metric_gaps`;
    a metric that only one run reports at a step is a gap of ``inf``."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    gaps = {}
    for k in sorted({k for r in a + b for k in r}):
        if k == "step" or k.startswith(CLOCKS):
            continue
        if any((k in x) != (k in y) for x, y in zip(a, b)):
            gaps[k] = float("inf")
            continue
        pairs = [(x[k], y[k]) for x, y in zip(a, b) if k in x]
        gaps[k] = max(abs(u - v) for u, v in pairs) / _scale(k, pairs)
    return gaps


def update_gap(out_a: Path, out_b: Path, step: int = STEPS) -> float:
    """The largest difference between two runs' weight updates (final - initial), in units of the learning rate:
    Adam moves an element by up to ~lr a step, and float noise in a gradient element near Adam's eps moves its
    update by up to ~lr / 2, so noise stays well below 1 while different training reaches several."""
    init, a, b = _initial(), _weights(out_a, step), _weights(out_b, step)
    return max(float(((a[k] - init[k]) - (b[k] - init[k])).abs().max()) for k in init) / LR


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _ray(out: Path, *overrides: str, resume: bool = False, push_weights: bool = True):
    from mmrlhf.launch.ray.driver import run_ray

    rc = run_ray(_config(out, "distributed.backend=ray", *overrides), resume=resume, push_weights=push_weights)
    assert rc == 0, rc
    return out


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    from mmrlhf.launch import run

    out = {}
    out["single"] = tmp_path_factory.mktemp("single")
    assert run(_config(out["single"], "trainer.save_steps=2")) == 0  # (the saves do not change the training)
    out["torchrun1"] = tmp_path_factory.mktemp("torchrun1")
    _torchrun1(_config(out["torchrun1"], "distributed.backend=torchrun", "trainer.save_steps=2"))
    out["ray"] = _ray(tmp_path_factory.mktemp("ray"), "trainer.save_steps=2")
    out["ray_2_trainers"] = _ray(tmp_path_factory.mktemp("ray2"), "distributed.num_trainer_actors=2",
                                 "distributed.trainer_actor_cpus=0.5", "distributed.rollout_actor_cpus=1")
    out["control"] = _ray(tmp_path_factory.mktemp("control"), push_weights=False)
    return out


def _torchrun1(config, *args: str) -> None:
    """``mmrlhf train`` of the recipe ``config`` under torchrun with one rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "mmrlhf",
           "train", str(ROOT / "examples/grpo_toy_shapes_cpu.yaml"), *[f"{k}={v}" for k, v in _flat(config)], *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                                         "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _flat(config) -> list[tuple[str, str]]:
    """The overrides that make the YAML recipe ``config`` (the keys these tests set), for the command line."""
    t = config.trainer
    return [("model.pretrain", config.model.pretrain), ("trainer.output_dir", t.output_dir),
            ("trainer.max_steps", t.max_steps), ("trainer.eval_steps", 0), ("trainer.progress_bar", "false"),
            ("trainer.tensorboard", "false"), ("trainer.report_steps", 0), ("trainer.save_steps", t.save_steps),
            ("distributed.backend", config.distributed.backend),
            *(tuple(key.split("=", 1)) for key in (*STATEFUL, *HALF_BATCH))]


@pytest.mark.parametrize("mode", ["torchrun1", "ray"])
def test_one_rank_in_every_launch_mode_trains_exactly_as_one_process(runs, mode):
    single, other = _rows(runs["single"]), _rows(runs[mode])
    assert len(single) == len(other) == STEPS
    gaps = metric_gaps(single, other)
    assert {"reward/mean", "policy/grad_norm", "policy/entropy", "policy/pg_loss", "samples"} <= set(gaps)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] <= 1e-5, worst
    assert update_gap(runs["single"], runs[mode]) < 0.02


def test_two_ray_trainer_actors_equal_one_process_within_reduction_noise(runs):
    single, two = _rows(runs["single"]), _rows(runs["ray_2_trainers"])
    # (the trainer actors make the experiences here, the reward's KL term reading the old policy: each scores its
    # own groups, so the scoring micro-batches follow the number of ranks, as the update's do)
    gaps = {k: v for k, v in metric_gaps(single, two).items() if not k.startswith("scoring/micro_batch")}
    print(f"\n2 trainer actors vs one process, largest metric gaps: {sorted(gaps.items(), key=lambda kv: -kv[1])[:5]}")
    assert {k for k in gaps if gaps[k] > 1e-5} <= {"policy/pg_loss", "policy/grad_norm", "policy/entropy",
                                                 "policy/approx_kl", "policy/clip_frac"}, gaps
    assert max(gaps.values()) <= 1e-4, gaps
    gap = update_gap(runs["single"], runs["ray_2_trainers"])
    print(f"\n2 trainer actors vs one process: worst metric gap {max(gaps.values()):.2e}, update gap {gap:.3f} lr")
    assert gap < 0.2


def test_control_without_the_weight_push_differs(runs):
    """The rollout actor receives every version number but no tensor, so it keeps sampling with the first policy:
    from step 2 its samples, hence the training, differ. And the sync check sees it: the engine-vs-trainer gap that
    stays at float noise in the synced run must show once the trainer has moved."""
    control = _rows(runs["control"])
    gaps = metric_gaps(_rows(runs["single"]), control)
    assert gaps["reward/mean"] > 1e-3 or gaps["policy/grad_norm"] > 1e-2, gaps
    assert update_gap(runs["single"], runs["control"]) > 0.5
    # (a step whose rounds found no group to train reports no engine check: the toy's fourth step here)
    check = "engine_logprob_diff/trainer_max"
    seen = [r[check] for r in control if check in r]
    synced = max(r[check] for r in _rows(runs["ray"]) if check in r)
    assert len(seen) >= STEPS - 1, seen
    print(f"\nengine-vs-trainer max |diff| per step without the push: {seen}; with it: <= {synced}")
    assert seen[0] < 1e-3  # the first step trains on version 0 either way
    # (an all-zero-reward first step may leave the policy unchanged: by the last step it has moved)
    assert seen[-1] > 1e-2 and seen[-1] > 100 * synced


def test_a_resumed_ray_run_continues_as_the_straight_run(runs, cluster, tmp_path):
    """A Ray run (``max_staleness`` 0) resumed from the module's straight Ray run's step-2 checkpoint continues
    exactly as the straight run (its saves change no metric). With ``max_staleness`` 1, where the next step's
    rollout is in flight at each save: the two-actor test below, every whole-step key on; a Ray run stopped by a
    signal and resumed: tests/launch/test_ray_training.py."""
    stopped = 2
    part = _ray(stopped_at(runs["ray"], tmp_path / "part", stopped), "trainer.save_steps=2", resume=True)
    a, b = _rows(runs["ray"]), _rows(part)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    gaps = every_metric_gaps(a[stopped:], b[stopped:])
    assert {"async/staleness_count_0", "async/staleness_mean", "ledger/consumed", "sync/megabytes"} <= set(gaps)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] <= 1e-5, worst
    assert update_gap(runs["ray"], part) < 0.02
    state = json.loads((part / "checkpoints" / f"step-{stopped:08d}" / "trainer_state.json").read_text())
    assert state["launch"] == "ray" and state["schema"] == 2
    assert state["rollouts"]["inflight"] == []  # nothing generated ahead at max_staleness 0


@pytest.mark.parametrize("mode", ["single", "torchrun1"])
def test_a_resumed_run_reports_every_metric_of_the_straight_run(runs, tmp_path, mode):
    """One process and torchrun (1 rank) resume their own straight run's step-2 checkpoint: steps 3 and 4 report
    every metric the straight run reported (the clocks aside), and the weights match. (Each against its own mode:
    the engines' float sums follow the process's threads, so ``engine_logprob_diff/mean`` differs across modes.)"""
    from mmrlhf.launch import run

    out = stopped_at(runs[mode], tmp_path, 2)
    if mode == "single":
        assert run(_config(out), resume=True) == 0
    else:
        _torchrun1(_config(out, "distributed.backend=torchrun"), "--resume")
    straight, resumed = _rows(runs[mode]), _rows(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    gaps = every_metric_gaps(straight[2:], resumed[2:])
    assert {"reward/mean", "policy/grad_norm", "samples", "engine_logprob_diff/max"} <= set(gaps)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] <= 1e-5, worst
    assert update_gap(runs[mode], out) < 0.02


def test_a_one_process_checkpoint_resumes_in_the_ray_mode(runs, tmp_path):
    """One checkpoint format: the one-process run's step-2 checkpoint, resumed by Ray (1 rollout actor, 1 trainer
    actor), trains steps 3 and 4 exactly as the one process did."""
    single = runs["single"]
    _ray(stopped_at(single, tmp_path, 2), resume=True)
    resumed = _rows(tmp_path)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    worst = sorted(metric_gaps(_rows(single)[2:], resumed[2:]).items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] <= 1e-5, worst
    assert update_gap(single, tmp_path) < 0.02
    state = json.loads((tmp_path / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert (state["launch"], state["world_size"]) == ("ray", 1)


def _ray_resumes_as_straight(tmp_path: Path, *keys: str, at_stop: Any = None) -> None:
    """A Ray run with ``keys`` and ``max_staleness`` 1, resumed from its own step-2 checkpoint (``at_stop(folder,
    steps, straight rows)`` sees it), continues exactly as the straight run."""
    k1 = (*keys, "distributed.max_staleness=1", "trainer.save_steps=1")
    straight = _ray(tmp_path / "straight", *k1)
    stopped = 2
    part = stopped_at(straight, tmp_path / "part", stopped)
    if at_stop is not None:
        at_stop(part, stopped, _rows(straight))
    _ray(part, *k1, resume=True)
    a, b = _rows(straight), _rows(part)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    gaps = every_metric_gaps(a[stopped:], b[stopped:])
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] <= 1e-5, worst
    assert update_gap(straight, part) < 0.02


def test_running_statistics_and_dynamic_sampling_train_in_ray_as_in_one_process(runs):
    """What carries from step to step on the rollout side (``STATEFUL``), in the Ray mode with one rollout actor
    (whose maker keeps the one running state) and ``max_staleness`` 0, trains as in one process (the same metrics
    and weights: test_one_rank_in_every_launch_mode_trains_exactly_as_one_process), and it is really there:

    - ``algorithm.reward_normalization`` and ``kl_controller: adaptive``, with advantage whitening (a batch
      statistic). The state matters: the KL coefficient moves every step.
    - ``algorithm.dynamic_sampling``: the rounds of a step read the stream and the sampling calls on from where the
      last step stopped, so the same prompts, samples and training follow. The toy's first steps need extra rounds
      (few rewarded groups), so a stream positioned per step would read other prompts.

    (That a resume restores this state and this stream as of the last trained step: the resume tests of this module;
    with the step generated ahead regenerated from it, by two actors that keep the same state: the two-actor test
    below.)"""
    one, ray_rows = _rows(runs["single"]), _rows(runs["ray"])
    gaps = metric_gaps(one, ray_rows)
    assert {"kl_coef", "advantage_std", "dynamic_sampling/rounds", "dynamic_sampling/kept_group_frac"} <= set(gaps)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] <= 1e-5, worst
    # A step whose rounds found no group with a reward spread trains nothing and reports no coefficient (the toy's
    # fourth step here); the coefficient moved at every step that trained.
    coef = [r["kl_coef"] for r in one if "kl_coef" in r]
    assert len(coef) >= STEPS - 1 and len(set(coef)) == len(coef), coef
    rounds = [r["dynamic_sampling/rounds"] for r in one]
    assert max(rounds) > 1, rounds  # extra rounds: a step reads more than its own batch of prompts


# Two rollout actors (half a CPU each) and one trainer actor on the suite's 2-CPU Ray.
TWO_ACTORS = ("distributed.num_rollout_actors=2", "distributed.rollout_actor_cpus=0.5")


def test_two_rollout_actors_take_the_step_together_and_resume_exactly(cluster, tmp_path):
    """Two rollout actors with every key that reads the whole step: advantage whitening (a batch statistic), reward
    normalisation and the adaptive KL coefficient (running state), dynamic sampling (the step's choice of groups).
    They meet in each step's collectives (``launch.ray.exchange``; exactness against one process on a synthetic step:
    tests/launch/test_collectives.py), so the shares end every step with the same statistics and state. A run with
    ``max_staleness`` 1 (each actor generates the next step while its last is trained), resumed from its step-2
    checkpoint, continues exactly as the straight run: the state, the stream and the in-order generation start
    where the checkpoint stood. (A Ray run stopped by a signal, then resumed: tests/launch/test_ray_training.py.)"""
    keys = TWO_ACTORS  # and the module's STATEFUL keys, as every run here

    def saved(part: Path, stopped: int, straight: list[dict]) -> None:
        state = json.loads((part / "checkpoints" / f"step-{stopped:08d}" / "trainer_state.json").read_text())
        assert state["launch"] == "ray" and state["schema"] == 2
        assert state["rollouts"]["maker"]["kl_controller"]["value"] == pytest.approx(straight[stopped]["kl_coef"],
                                                                                      rel=1e-6)
        assert len(state["rollouts"]["inflight"]) == 1  # the next step's rollout was in flight at the save

    _ray_resumes_as_straight(tmp_path, *keys, at_stop=saved)
    rows = _rows(tmp_path / "straight")
    assert len({r["kl_coef"] for r in rows}) == STEPS  # the coefficient moved at every step, the same on both shares
    for r in rows:
        # the step's rounds, decided together (both shares report the same number: the merged one is whole)
        assert r["dynamic_sampling/rounds"] == int(r["dynamic_sampling/rounds"]) >= 1
        assert r["ledger/produced"] == r["ledger/consumed"]
