"""Helpers shared by the launch tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def stopped_at(run: Path, out: Path, step: int) -> Path:
    """``out`` as the finished run ``run`` would have left it had it stopped after ``step``: its checkpoint of that
    step (the run's output folder rewritten to ``out`` and the manifest sealed again) and its first ``step`` metrics
    rows. A resume of ``out`` then trains the steps after ``step`` as ``run`` did, without a run of its own to stop
    (a launch costs several times a toy step)."""
    from mmrlhf.trainer.checkpoint_manifest import write_manifest

    name = f"step-{step:08d}"
    folder = out / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / name, folder / name)
    (folder / "latest").write_text(name + "\n")
    state_file = folder / name / "trainer_state.json"  # as if the run had been in this folder
    state = json.loads(state_file.read_text())
    state["config"]["trainer"]["output_dir"] = str(out)
    state_file.write_text(json.dumps(state))
    write_manifest(folder / name)  # re-sealed after the edit, or the resume would find it damaged
    rows = (run / "metrics.jsonl").read_text().splitlines()[:step]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in rows))
    return out


# ---- runs of the toy recipe compared across rank counts and nodes (test_rank_changes.py, test_ray_nodes.py) ------
# Greedy decoding (rollout.temperature=0, one answer a prompt: vLLM samples greedy requests once) makes a step's
# answers independent of the ranks' sampling seeds, so a run continued on another number of ranks generates what the
# straight run generates and trains it within fp32 reduction noise. REINFORCE's advantages (the rewards, whitened over
# the step) then still differ between the prompts, and the KL and entropy terms move every weight.
GREEDY_TOY = ("trainer.eval_steps=0", "trainer.report_steps=0", "trainer.progress_bar=false",
              "trainer.tensorboard=false", "trainer.save_steps=1", "rollout.temperature=0",
              "rollout.n_samples_per_prompt=1",
              "trainer.rollout_batch_size=32", "trainer.train_batch_size=32", "trainer.micro_train_batch_size=32",
              "algorithm.advantage_estimator=reinforce", "algorithm.kl_loss_coef=0.05", "algorithm.entropy_coef=0.01",
              'reward.label_map={first_word: {type: function, function: '
              '"mmrlhf.testing.rewards:response_length_reward"}}')
GREEDY_TOY_LR = 3.0e-4  # examples/grpo_toy_shapes_cpu.yaml
# The metrics the float order of sums over ranks may move by more than 1e-5 of their scale (test_one_loop.py's
# two-trainer-actor comparison); every other metric of a continued run must be the straight run's to 1e-5.
REDUCTION_NOISE_KEYS = {"policy/pg_loss", "policy/grad_norm", "policy/entropy", "policy/approx_kl", "policy/clip_frac"}
# Not compared: clocks, the engine's own numerics, what one mode alone logs, and the micro-batch sizes (each rank's
# own forwards: they follow the number of ranks).
NOT_COMPARED = ("time/", "throughput/", "sync/", "async/", "ledger/", "engine_logprob_diff/", "rollout_is/", "ray/",
                "policy/micro_batch", "policy/oversized_micro_batches", "scoring/micro_batch")


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def training_gaps(a: list[dict], b: list[dict], *, skip: tuple[str, ...] = NOT_COMPARED,
                  term_scale: dict[str, float] | None = None) -> dict[str, float]:
    """Per training metric both runs report (``skip``'s prefixes left out), the largest |a - b| over the rows
    relative to the metric's largest |value|, or to its ``term_scale`` (default: 1 for GRPO / REINFORCE's policy
    loss, a mean of O(1) terms that sums to ~0)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    term_scale = {"policy/pg_loss": 1.0} if term_scale is None else term_scale
    gaps = {}
    for key in sorted({k for r in a for k in r} & {k for r in b for k in r}):
        if key == "step" or key.startswith(skip):
            continue
        pairs = [(x[key], y[key]) for x, y in zip(a, b)]
        scale = term_scale.get(key) or max(max(abs(u), abs(v)) for u, v in pairs) or 1.0
        gaps[key] = max(abs(u - v) for u, v in pairs) / scale
    return gaps


def checkpoint_weights(out: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(next((out / "checkpoints" / f"step-{step:08d}" / "model").glob("*.safetensors"))))


def tiny_update(out: Path, step: int) -> dict:
    """A run's weight update from the tiny Qwen2-VL it started from (seed 0) to its checkpoint of ``step``."""
    from safetensors.torch import load_file

    from mmrlhf.testing.tiny_models import tiny_model_dir

    init = load_file(str(next(Path(tiny_model_dir("qwen2_vl", "tiny", 0)).glob("*.safetensors"))))
    final = checkpoint_weights(out, step)
    return {k: final[k] - init[k] for k in init}


def update_gap(a: Path, b: Path, step: int, since: dict) -> float:
    """The largest difference of two runs' weight updates from ``since`` (a state dict) to ``step``, in units of
    the learning rate (Adam moves an element by up to ~lr a step; float noise in a gradient element near Adam's eps
    moves its update by up to ~lr / 2)."""
    wa, wb = checkpoint_weights(a, step), checkpoint_weights(b, step)
    return max(float(((wa[k] - since[k]) - (wb[k] - since[k])).abs().max()) for k in since) / GREEDY_TOY_LR
