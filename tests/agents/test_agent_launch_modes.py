"""Multi-turn tool rollouts in every launch mode, through the one training loop: the zoom toy recipe trains the
same in one process, under torchrun with one rank and in the Ray mode (one rollout actor, one trainer actor);
torchrun with two ranks, whose trajectories take different numbers of turns, finishes (the update pairs its
collectives) and reports the agent metrics. Every mode leaves the same kinds of output files (metrics, TensorBoard,
curves, config, the rollout reports of a report step inside the run and of the last, checkpoints), and the Ray
mode's report shows the trajectories' tool turns as the others' do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ray  # noqa: E402  (requirements/project.txt installs it)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]  # ~2 min alone on the 2-core machine: four short runs

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples/agent_zoom_toy_cpu.yaml"
STEPS = 3


def _overrides(out: Path) -> list[str]:
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return [f"model.pretrain={tiny_model_dir('qwen2_vl', tools=True)}", f"trainer.output_dir={out}",
            f"trainer.max_steps={STEPS}", "trainer.eval_steps=0", "trainer.progress_bar=false",
            "trainer.report_steps=2", "trainer.save_steps=2",  # a report and a checkpoint inside the run, and at its end
            "trainer.rollout_batch_size=4", "trainer.train_batch_size=64", "trainer.micro_train_batch_size=64"]


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
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
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
    assert all(r["samples"] == 64 for r in rows)  # both ranks' trajectories reached the step


def output_kinds(out: Path) -> set[str]:
    """The files a run left in ``out``, as kinds: every number (step, rank, shard) as ``N`` and a TensorBoard event
    file (named by time, host and process) as ``events.out.tfevents.*``, so runs of different modes, hosts and times
    compare."""
    kinds = set()
    for path in out.rglob("*"):
        if path.is_file():
            name = re.sub(r"events\.out\.tfevents\..*$", "events.out.tfevents.*", path.relative_to(out).as_posix())
            kinds.add(re.sub(r"\d+", "N", name))
    return kinds


def test_every_launch_mode_writes_the_same_kinds_of_output(runs):
    kinds = {mode: output_kinds(runs[mode]) for mode in ("single", "torchrun2", "ray")}
    expected = {"metrics.jsonl", "config.yaml", "curves.png", "report.html", "reports/step-N.html",
                "tensorboard/events.out.tfevents.*", "checkpoints/step-N/trainer_state.json",
                "checkpoints/step-N/model/config.json"}
    for mode, found in kinds.items():
        assert expected <= found, (mode, sorted(expected - found))
    assert kinds["torchrun2"] == kinds["single"], sorted(kinds["torchrun2"] ^ kinds["single"])
    assert kinds["ray"] == kinds["single"], sorted(kinds["ray"] ^ kinds["single"])
    for mode in ("single", "torchrun2", "ray"):  # the report step inside the run, and the last one
        assert sorted(p.name for p in (runs[mode] / "reports").iterdir()) == ["step-00000002.html",
                                                                              "step-00000003.html"], mode
        assert sorted(p.name for p in (runs[mode] / "checkpoints").glob("step-*")) == ["step-00000002",
                                                                                       "step-00000003"], mode


def test_the_ray_report_shows_the_trajectories_tool_turns(runs):
    pages = {mode: (runs[mode] / "report.html").read_text() for mode in ("single", "ray")}
    for mode, page in pages.items():
        assert "step 3</h1>" in page, mode
        assert page.count('class="turn tool') > 0, mode  # observations, each a tool turn of a trajectory
        assert "image_zoom(" in page, mode  # the calls, as the tool received them
        images = len(re.findall(r'src="data:image/png;base64,', page))
        assert images > page.count("<section"), mode  # tool images besides each group's prompt image
    # one rollout actor and one trainer actor sample exactly what one process samples: the same cards
    cards = {mode: re.findall(r'<ol class="turns">.*?</ol>', re.sub(r"\(\d+\.\d+ s\)", "", page), flags=re.S)
             for mode, page in pages.items()}  # each tool turn's latency left out: a clock
    assert cards["ray"] == cards["single"] and cards["single"]
