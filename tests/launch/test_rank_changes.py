"""A checkpoint written by N torchrun ranks resumes on M: 1 -> 2 and 2 -> 1.

A one-process run of the greedy toy recipe (``launch_testing.GREEDY_TOY``: 32 prompts a step, one greedy answer each,
REINFORCE, KL and entropy terms) trains 3 steps with a checkpoint after each; its step-1 checkpoint resumed by
``torchrun --nproc-per-node 2`` trains steps 2 and 3 (1 -> 2 ranks: the optimiser state, saved by one process
through torch.distributed.checkpoint, re-sharded over two FSDP2 ranks; the data stream and the counters of rank 0
read on), and that run's step-2 checkpoint (written by 2 ranks) resumed in one process trains step 3 (2 -> 1). Both
continue the straight run within fp32 reduction noise: every training metric to 1e-5 of its scale (the few a sum over
ranks moves, to 1e-4), the weights' updates within a few hundredths of the learning rate.

Why greedy: torchrun ranks sample with seeds of their own (docs/distributed.md, "Rank seeds") over their own share
of the prompts, so with temperature > 0 a run continued on another number of ranks draws other answers than the
straight run and the two agree only in distribution. Greedy answers do not depend on the seeds, so the continued run
trains what the straight run trained, and what differs can only be what the resume restored.

A rank's random states are restored where it sees fewer GPUs than the rank that saved them (the fast test at the end).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch_testing import GREEDY_TOY, GREEDY_TOY_LR, REDUCTION_NOISE_KEYS, checkpoint_weights, metric_rows, \
    stopped_at, training_gaps, update_gap

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples/grpo_toy_shapes_cpu.yaml"
STEPS = 3


def _model() -> str:
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return str(tiny_model_dir("qwen2_vl", "tiny", 0))


def _args(out: Path) -> list[str]:
    return [f"model.pretrain={_model()}", f"trainer.output_dir={out}", f"trainer.max_steps={STEPS}", *GREEDY_TOY]


def _one_process(out: Path, *, resume: bool = False) -> Path:
    from mmrlhf.config import load_config
    from mmrlhf.launch import run

    assert run(load_config(TOY, _args(out)), resume=resume) == 0
    return out


def _two_ranks(out: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "mmrlhf.cli",
           "train", str(TOY), *_args(out), "--resume"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    straight = _one_process(tmp_path_factory.mktemp("straight"))
    onto_two = stopped_at(straight, tmp_path_factory.mktemp("one_to_two"), 1)
    log = _two_ranks(onto_two)
    onto_one = _one_process(stopped_at(onto_two, tmp_path_factory.mktemp("two_to_one"), 2), resume=True)
    return {"straight": straight, "one_to_two": onto_two, "two_to_one": onto_one, "log": log}


def _initial() -> dict:
    from safetensors.torch import load_file

    return load_file(str(next(Path(_model()).glob("*.safetensors"))))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name, since, writer, reader", [("one_to_two", 1, ("single", 1), ("torchrun", 2)),
                                                         ("two_to_one", 2, ("torchrun", 2), ("single", 1))])
def test_a_checkpoint_resumed_on_another_number_of_ranks_continues_the_straight_run(runs, name, since, writer,
                                                                                      reader):
    from mmrlhf.trainer.checkpoint import checkpoint_mode

    out = runs[name]
    assert checkpoint_mode(out / "checkpoints" / f"step-{since:08d}")[:2] == writer  # who wrote the resumed one
    assert checkpoint_mode(out / "checkpoints" / f"step-{STEPS:08d}")[:2] == reader  # who trained after it
    if reader[1] == 2:
        assert "resuming a checkpoint written by single with 1 rank(s) as torchrun with 2" in runs["log"]
        assert f"done: step {STEPS} on 2 ranks" in runs["log"]
    straight, rows = metric_rows(runs["straight"]), metric_rows(out)
    assert [r["step"] for r in rows] == [r["step"] for r in straight] == [1, 2, 3]
    # the control of the data position: every step reads other prompts (a stream read again from its start, or
    # from another place, would train other answers)
    assert len({r["reward/mean"] for r in straight}) == STEPS
    gaps = training_gaps(straight[since:], rows[since:])
    assert {"reward/mean", "policy/grad_norm", "policy/entropy", "policy/kl_loss", "samples"} <= set(gaps)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:4]
    print(f"\n{name}: largest metric gaps {worst}")
    assert {k for k, v in gaps.items() if v > 1e-5} <= REDUCTION_NOISE_KEYS and worst[0][1] <= 1e-4, worst
    gap = update_gap(runs["straight"], out, STEPS, _initial())
    # the control of the optimiser state: the steps after the resume moved the weights by far more than that gap
    # (a fresh AdamW's first update is lr * sign(g) wherever |g| >> eps: it would be off by about lr)
    a, b = checkpoint_weights(runs["straight"], STEPS), checkpoint_weights(runs["straight"], since)
    moved = max(float((a[k] - b[k]).abs().max()) for k in a) / GREEDY_TOY_LR
    print(f"{name}: update gap at step {STEPS} {gap:.2e} lr; the straight run moved {moved:.2f} lr since step {since}")
    assert gap < 0.05 and moved > 0.5, (gap, moved)
    steppers = json.loads(json.dumps(_steppers(out)))
    assert steppers["policy"]["steps"] == STEPS  # the optimiser's count went on from the checkpoint


def _steppers(out: Path) -> dict:
    import torch

    return torch.load(out / "checkpoints" / f"step-{STEPS:08d}" / "steppers.pt", weights_only=True)


def test_random_states_resume_on_a_process_that_sees_fewer_gpus(monkeypatch):
    """A torchrun rank of a node saves the generator of every GPU it sees (here 12); resumed by a process that sees
    fewer (a Ray trainer actor sees its one GPU; a rank of a 4-GPU node, 4), each of its devices gets the state of
    the device of the same index, in device order (``torch_cuda_10`` after ``torch_cuda_9``), and none is asked for
    a device it does not have (torch raises for one)."""
    import torch

    from mmrlhf.trainer.state import restore_rng, rng_state_json, rng_state_tensors

    saved = {**rng_state_tensors(), **{f"torch_cuda_{i}": torch.full((4,), i, dtype=torch.uint8) for i in range(12)}}
    for visible in (1, 4, 12):
        set_states: list = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: set_states.extend(states))
        restore_rng(rng_state_json(), saved)
        assert [int(s[0]) for s in set_states] == list(range(visible))
