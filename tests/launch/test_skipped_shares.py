"""A skipped prompt never ends a multi-rank run: every rank and every rollout actor whose share of a step is empty
trains an inert sample beside the others, and a step with nothing on any of them is one clear error.

Each run reads 10 file records in order (``data.shuffle=false``), 2 a step, one to each of 2 ranks (torchrun) or
2 rollout actors (Ray), so that each of steps 1-4 leaves one share empty for another reason:

- step 1: rank 1's record names a missing image (``data.on_bad_input=skip``);
- step 2: rank 0's prompt is over ``data.prompt_max_len`` (``data.prompt_overflow=skip``);
- step 3: rank 1's prompt fits the data limit but not the engine's context (``rollout.prompt_too_long=skip``; in
  an agent run the trajectory budget ends its trajectories before their first turn);
- step 4 (agent runs): rank 0's environment answers its reset with a first observation that does not fit the
  context, so all its trajectories end before their first turn (single-turn runs: both records train);
- step 5: both records name missing images: the run ends with one error naming the step and both records.

Single-turn (the toy recipe) and agent (the same with an environment) runs, under torchrun and in the Ray mode:
four launches, each of 4 short steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ray  # noqa: E402  (requirements/project.txt installs it)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples/grpo_toy_shapes_cpu.yaml"
QUESTION = "What color is the square? "
ENVIRONMENT = '''
from mmrlhf.agents.types import StepResult, ToolResult


class FirstObservation:
    """Answers the reset with a first observation: a short one, or (a record with ``flood``) one no context holds."""

    def reset(self, record):
        return ToolResult(text=("colour " * 400) if record.get("flood") else "look")

    def step(self, action_text):
        return StepResult(ToolResult(text="done"), done=True)
'''


def _records(folder: Path) -> Path:
    """The 10 records of the module docstring, a blue square image beside them; returns the data file."""
    from PIL import Image

    Image.new("RGB", (56, 56), (30, 30, 200)).save(folder / "blue.png")

    def record(i: int, *, image: str = "blue.png", repeat: int = 1, **extra) -> dict:
        return {"prompt": "<image>" + QUESTION * repeat + "Answer with one word.", "images": [image],
                "reference": "blue", "id": f"q{i}", **extra}

    rows = [record(0), record(1, image="gone.png"),
            record(2, repeat=30), record(3),  # ~230 tokens: over prompt_max_len 200
            record(4), record(5, repeat=18),  # ~150 tokens: under 200, over the engine's 128 - 2 new tokens
            record(6, flood=True), record(7),
            record(8, image="gone.png"), record(9, image="gone.png")]
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(folder: Path, out: Path, agent: bool) -> list[str]:
    from mmrlhf.testing.tiny_models import tiny_model_dir

    args = [f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}", f"trainer.output_dir={out}",
            f"data.prompt_data=[{_records(folder)}]", "data.generator=null", "data.shuffle=false",
            "data.on_bad_input=skip", "data.prompt_overflow=skip", "data.prompt_max_len=200",
            "rollout.prompt_too_long=skip", "trainer.eval_steps=0", "trainer.report_steps=0",
            "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.save_steps=1000",
            "trainer.max_steps=6", "trainer.rollout_batch_size=2", "trainer.train_batch_size=32",
            "rollout.n_samples_per_prompt=16", "rollout.micro_rollout_batch_size=16",
            "trainer.micro_train_batch_size=16",
            "algorithm.entropy_coef=0.01"]  # a gradient even where a random policy's group has no reward spread
    if agent:
        env = folder / "first_observation.py"
        env.write_text(ENVIRONMENT)
        args += [f"agent.environment={env}:FirstObservation", "agent.max_turns=2"]
    return args


def _check(out: Path, stderr: str, agent: bool) -> None:
    """Steps 1-4 trained (one share's samples each of steps 1-3, both shares' at step 4 unless an environment
    flooded one), every skip counted once; step 5 ended the run with the error naming its records."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4], stderr[-4000:]
    # (in an agent run a prompt over the context is the trajectory budget's: ended before its first turn)
    assert [r["skipped_prompts"] for r in rows] == ([1, 1, 0, 0] if agent else [1, 1, 1, 0])
    assert [r["samples"] for r in rows] == [16, 16, 16, 16 if agent else 32]
    assert [r["train/samples_trained"] for r in rows] == [16, 16, 16, 16 if agent else 32]
    for r in rows:  # each step trained the shares that had samples (the inert one beside them trains nothing)
        assert r["policy/optimizer_steps"] == 1 and r["policy/grad_norm"] > 0, r
    if agent:
        assert [r["agent/ended/before_first_turn/count"] for r in rows] == [0, 0, 16, 16]
    assert "step 5: no sample to train on any of the 2 ranks / rollout actors" in stderr, stderr[-4000:]
    for rid in ("q8", "q9"):
        assert f"id='{rid}'" in stderr
    # one error line, no traceback of ours (torchrun's launcher still prints its own when a rank exits with 1)
    assert not [line for line in stderr.splitlines() if line.strip().startswith('File "') and str(ROOT / "mmrlhf") in line]


def _torchrun(folder: Path, out: Path, agent: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "mmrlhf.cli",
           "train", str(TOY), *_overrides(folder, out, agent)]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.parametrize("agent", [False, True], ids=["single_turn", "agent"])
def test_torchrun_ranks_train_beside_an_empty_share_and_stop_at_an_empty_step(tmp_path, agent):
    out = tmp_path / "run"
    proc = _torchrun(tmp_path, out, agent)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    _check(out, proc.stderr, agent)
    # the empty rank said so, once per step it was empty (steps 1 and 3: rank 1; 2 and 4: rank 0)
    for step, rank in ((1, 1), (2, 0), (3, 1)) + (((4, 0),) if agent else ()):
        assert proc.stderr.count(f"step {step}: share {rank} of 2 has no sample (") == 1, step
    if agent:  # the flooded share names why it made no sample
        assert "made no sample of the 1 prompt(s) left (multi-turn: every trajectory ended before" in proc.stderr


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("agent", [False, True], ids=["single_turn", "agent"])
def test_ray_rollout_actors_train_beside_an_empty_share_and_stop_at_an_empty_step(cluster, tmp_path, capfd, agent):
    from mmrlhf.config import load_config
    from mmrlhf.launch.ray.driver import run_ray

    out = tmp_path / "run"
    config = load_config(TOY, [*_overrides(tmp_path, out, agent), "distributed.backend=ray",
                               "distributed.num_rollout_actors=2", "distributed.rollout_actor_cpus=0.5",
                               "distributed.trainer_actor_cpus=0.5"])
    code = run_ray(config)
    captured = capfd.readouterr()
    assert code == 1, captured.err[-5000:]
    _check(out, captured.err, agent)
