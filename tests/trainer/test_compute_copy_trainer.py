"""``trainer.compute_copy`` through the trainer: bf16 compute over float32 masters with the copy cast once per
optimiser step trains exactly as autocast's per-forward casts (metrics and saved weights bit for bit), for the
policy and for PPO's critic, over several optimiser steps per rollout step. Control: copies that are not cast
again after an optimiser step (stale weights in the next mini-batch) change the run."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.models.compute_copy import ComputeCopy
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.updates import load_weights, moved_fraction
from trainer_helpers import metrics_rows, stable, toy_config


def _run(out, compute_copy, estimator: str, steps: int = 3):
    from mmrlhf.trainer.builder import build_trainer

    # 16 samples a step, mini-batches of 8 in micro-batches of 4: two optimiser steps per rollout step
    # (a reward that varies within groups of the untrained model: the toy task's is ~0 for it, nothing would train)
    cfg = toy_config(out, model={"dtype": "bfloat16"}, algorithm={"advantage_estimator": estimator},
                     reward={"label_map": {"parity": {"type": "function",
                                                      "function": "trainer_helpers:parity_reward"}},
                             "default_recipe": [["parity", 1.0]]},
                     trainer={"compute_copy": compute_copy, "max_steps": steps, "save_steps": steps})
    trainer = build_trainer(cfg)
    stepper = trainer.p.policy.stepper
    copies = [stepper.compute_copy]
    if estimator == "gae":
        copies.append(trainer.p.critic.stepper.compute_copy)
    with trainer.p.tracker:
        trainer.fit()
    weights = load_weights(trainer.p.checkpoints.latest() / "model")
    return [stable(r) for r in metrics_rows(out)], weights, copies


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_the_copy_trains_bit_for_bit_like_autocast(tmp_path, estimator):
    rows_off, weights_off, copies_off = _run(tmp_path / "off", False, estimator)
    rows_on, weights_on, copies_on = _run(tmp_path / "on", True, estimator)
    assert all(c is None for c in copies_off)
    assert all(isinstance(c, ComputeCopy) and c.slots for c in copies_on)
    assert all(s.copy is None for c in copies_on for s in c.slots)  # released after each update
    assert len(rows_on) == 3 and rows_on == rows_off
    assert weights_on.keys() == weights_off.keys()
    changed = [k for k in weights_on if not torch.equal(weights_on[k], weights_off[k])]
    assert not changed, changed[:5]
    initial = load_weights(tiny_model_dir("qwen2_vl"))
    assert moved_fraction(initial, weights_on) > 0.3  # the runs trained: the equality is not vacuous


def test_stale_copies_change_the_run(tmp_path, monkeypatch):
    """Control: the copies cast once and never again (the optimiser's steps unseen) train differently."""
    _, weights_on, _ = _run(tmp_path / "on", True, "grpo", steps=1)
    refresh = ComputeCopy._refresh

    def first_only(self):
        if getattr(self, "_cast_once", False):
            return 0
        self._cast_once = True
        return refresh(self)

    monkeypatch.setattr(ComputeCopy, "_refresh", first_only)
    _, weights_stale, _ = _run(tmp_path / "stale", True, "grpo", steps=1)
    assert any(not torch.equal(weights_stale[k], weights_on[k]) for k in weights_on)


def test_auto_is_off_with_gradient_checkpointing_and_in_float32(tmp_path):
    from mmrlhf.trainer.builder import compute_copy

    class _Model(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.compute_dtype = dtype

    bf16, fp32 = _Model(torch.bfloat16), _Model(None)
    t = toy_config(tmp_path).trainer
    assert t.compute_copy == "auto"
    assert isinstance(compute_copy(bf16, t, "policy"), ComputeCopy)
    assert compute_copy(fp32, t, "policy") is None  # float32 compute (or FSDP2's casts): nothing to copy
    checkpointed = t.model_copy(update={"gradient_checkpointing": True})
    assert compute_copy(bf16, checkpointed, "policy") is None
    assert isinstance(compute_copy(bf16, checkpointed.model_copy(update={"compute_copy": True}), "policy"),
                      ComputeCopy)
    assert compute_copy(bf16, t.model_copy(update={"compute_copy": False}), "policy") is None
