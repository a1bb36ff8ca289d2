"""Multi-turn tool rollouts in every launch mode, through the one training loop: the zoom toy recipe trains the
same in one process, under torchrun with one rank and in the Ray mode (one rollout actor, one trainer actor);
torchrun with two ranks, whose trajectories take different numbers of turns, finishes (the update pairs its
collectives) and reports the agent metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ray  # noqa: E402  (requirements/project.txt installs it)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]  # ~3 min on the 2-core machine: five short runs

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples/agent_zoom_toy_cpu.yaml"
STEPS = 3


def _overrides(out: Path) -> list[str]:
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return [f"model.pretrain={tiny_model_dir('qwen2_vl', tools=True)}", f"trainer.output_dir={out}",
            f"trainer.max_steps={STEPS}", "trainer.eval_steps=0", "trainer.progress_bar=false",
            "trainer.tensorboard=false", "trainer.report_steps=0", "trainer.save_steps=1000",
            "trainer.rollout_batch_size=8", "trainer.train_batch_size=128", "trainer.micro_train_batch_size=128"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _torchrun(out: Path, ranks: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
           "mmrlhf", "train", str(RECIPE), *_overrides(out), "distributed.backend=torchrun"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mmrlhf.config import load_config
    from mmrlhf.launch import run
    from mmrlhf.launch.ray.driver import run_ray

    out = {name: tmp_path_factory.mktemp(name) for name in ("single", "torchrun1", "torchrun2", "ray")}
    assert run(load_config(RECIPE, _overrides(out["single"]))) == 0
    for name, ranks in (("torchrun1", 1), ("torchrun2", 2)):
        proc = _torchrun(out[name], ranks)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert run_ray(load_config(RECIPE, [*_overrides(out["ray"]), "distributed.backend=ray"])) == 0
    finally:
        ray.shutdown()
    return out


SAME = ("reward/mean", "agent/tool_use_rate", "agent/turns/mean", "agent/observation_tokens/mean",
        "agent/policy_tokens/mean", "response_length/mean", "policy/grad_norm", "policy/entropy")


@pytest.mark.parametrize("mode", ["torchrun1", "ray"])
def test_one_rank_in_every_launch_mode_trains_as_one_process(runs, mode):
    single, other = _rows(runs["single"]), _rows(runs[mode])
    assert [r["step"] for r in single] == [r["step"] for r in other] == list(range(1, STEPS + 1))
    for key in SAME:
        for a, b in zip(single, other):
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1.0), (mode, key, a[key], b[key])
    assert any(r["agent/observation_tokens/mean"] > 0 for r in single)  # trajectories did call the tool


def test_two_torchrun_ranks_with_different_turns_finish(runs):
    rows = _rows(runs["torchrun2"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(0.0 < r["agent/tool_use_rate"] < 1.0 for r in rows)  # ranks held trajectories of 1 and 2 turns
    assert all(r["samples"] == 128 for r in rows)  # both ranks' trajectories reached the step
