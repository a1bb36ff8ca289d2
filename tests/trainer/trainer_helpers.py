"""Small trainer configs on the toy shapes task for the trainer tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mmrlhf.config import build_config
from mmrlhf.testing.tiny_models import tiny_model_dir

VOLATILE = ("time/", "throughput/", "sync/seconds")  # wall-clock metrics: never equal between runs


def toy_config(out: Path, *, engine: str = "transformers", family: str = "qwen2_vl", **sections: dict[str, Any]):
    """A 4-prompt x 4-sample GRPO run of the colour task; ``sections`` update the config sections."""
    data: dict[str, Any] = {
        "model": {"pretrain": str(tiny_model_dir(family)), "dtype": "float32"},
        "data": {"generator": "mmrlhf.tasks.shapes:make_record", "generator_options": {"task": "colour"},
                 "prompt_max_len": 64, "eval_size": 8},
        "rollout": {"engine": engine, "n_samples_per_prompt": 4, "max_new_tokens": 2, "max_model_len": 128,
                    "micro_rollout_batch_size": 16, "seed": 1},
        "reward": {"label_map": {"first_word": {"type": "function",
                                                "function": "mmrlhf.tasks.shapes:first_word_reward"}},
                   "default_recipe": [["first_word", 1.0]]},
        "algorithm": {"advantage_estimator": "grpo"},
        "trainer": {"lr": 1e-3, "rollout_batch_size": 4, "train_batch_size": 8, "micro_train_batch_size": 4,
                    "max_steps": 3, "save_steps": 100, "report_steps": 0, "output_dir": str(out),
                    "progress_bar": False, "tensorboard": False, "seed": 5},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return build_config(data)


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def stable(row: dict) -> dict:
    """A metrics row without the wall-clock entries."""
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def constant_reward(responses, prompts, labels, references):
    return [1.0] * len(responses)


def one_varying_group_reward(responses, prompts, labels, references):
    """Reward variance in exactly one group per call (the first prompt's samples score 1, 0, 0, ...; every other
    group is flat): dynamic sampling then keeps one group per round and needs as many rounds as groups."""
    first, out, seen = prompts[0], [], 0
    for prompt in prompts:
        out.append(float(prompt == first and seen == 0))
        seen += prompt == first
    return out


def parity_reward(responses, prompts, labels, references):
    """1 when the response's characters sum to an even code: varies within groups of a random tiny model, so GRPO
    has advantages to learn from (the toy task's reward is ~0 everywhere for an untrained model)."""
    return [float(sum(map(ord, r)) % 2 == 0) for r in responses]


FLAKY_CALLS: list[int] = []


def flaky_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high):
    """A policy loss whose first call is NaN (a one-off overflow), then the plain policy gradient."""
    FLAKY_CALLS.append(1)
    loss = -(logprobs - old_logprobs).exp() * advantages
    return (loss * float("nan") if len(FLAKY_CALLS) == 1 else loss), {}


def nan_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high):
    """Always NaN: a broken run."""
    return logprobs * float("nan"), {}


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut a file to ``keep`` of its bytes (what a preempted copy or a full disk leaves)."""
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def flip_a_byte(path: Path) -> None:
    """Change one byte in the middle of a file, keeping its size (what only a checksum sees)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
