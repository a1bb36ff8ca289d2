"""Keys changed on --resume: refused ones are named before anything loads; the learning rate and the KL
controller's settings are written into the restored state (the record then tells the truth); pure diffing."""

from __future__ import annotations

import pytest

from mmrlhf.trainer.builder import build_trainer
from mmrlhf.trainer.resume_changes import Change, check_changes, config_changes
from trainer_helpers import toy_config


def test_changes_are_found_and_refused_keys_named():
    saved = {"model": {"dtype": "float32", "lora": {"rank": 0}}, "trainer": {"lr": 1e-3, "max_steps": 3},
             "data": {"generator_options": {"task": "colour"}}}
    new = {"model": {"dtype": "bfloat16", "lora": {"rank": 8}}, "trainer": {"lr": 5e-4, "max_steps": 3},
           "data": {"generator_options": {"task": "count"}}}
    assert [c.key for c in config_changes(saved, new)] == [
        "data.generator_options.task", "model.dtype", "model.lora.rank", "trainer.lr"]
    with pytest.raises(ValueError) as err:
        check_changes(saved, new, "ckpt")
    text = str(err.value)
    assert "model.dtype: 'float32' -> 'bfloat16'" in text and "model.lora.rank" in text
    assert "data.generator_options.task" in text and "trainer.lr" not in text
    assert check_changes(saved, {**saved, "trainer": {"lr": 5e-4, "max_steps": 9}}, "ckpt") == [
        Change("trainer.lr", 1e-3, 5e-4), Change("trainer.max_steps", 3, 9)]


def test_a_key_added_after_the_checkpoint_counts_as_its_default():
    """A checkpoint written before a key existed (here model.teacher, under the refused ``model.`` section) resumes
    when the new config leaves the key at its default, and is refused when it sets it."""
    from mmrlhf.config import build_config

    new = build_config({"model": {"pretrain": "/models/policy"}}).model_dump(mode="json")
    saved = {**new, "model": {k: v for k, v in new["model"].items() if k != "teacher"}}
    assert check_changes(saved, new, "ckpt") == []
    assert [c.key for c in config_changes(saved, new)] == ["model.teacher"]  # without the defaults: a change
    teacher = {**new, "model": {**new["model"], "teacher": "/models/teacher"}}
    with pytest.raises(ValueError, match=r"model\.teacher: '' -> '/models/teacher'"):
        check_changes(saved, teacher, "ckpt")


def _lrs(trainer):
    return [g["lr"] for g in trainer.p.policy.stepper.optimizer.param_groups]


@pytest.mark.slow
def test_resume_applies_a_new_learning_rate_and_kl_target_and_refuses_a_new_model_dtype(tmp_path, capsys):
    algo = {"kl_reward_coef": 0.05, "kl_controller": "adaptive", "kl_target": 6.0}
    base = dict(trainer={"max_steps": 2, "save_steps": 2, "lr": 1e-3, "lr_scheduler": "cosine"}, algorithm=algo)
    first = build_trainer(toy_config(tmp_path / "run", **base))
    with first.p.tracker:
        first.fit()
    lr_factor = _lrs(first)[0] / 1e-3

    # control: the same keys resume with the restored values
    same = build_trainer(toy_config(tmp_path / "run", trainer={**base["trainer"], "max_steps": 3}, algorithm=algo),
                         resume=True)
    assert _lrs(same)[0] == pytest.approx(1e-3 * lr_factor)

    changed = build_trainer(toy_config(tmp_path / "run", trainer={**base["trainer"], "max_steps": 3, "lr": 2e-4},
                                       algorithm={**algo, "kl_target": 3.0}), resume=True)
    assert _lrs(changed)[0] == pytest.approx(2e-4 * lr_factor)  # the schedule continues, from the new base
    assert changed.p.policy.stepper.scheduler.base_lrs == [2e-4] * len(_lrs(changed))
    assert changed.p.source.maker.kl_controller.target == 3.0
    err = capsys.readouterr().err
    assert "resume: trainer.lr: 0.001 -> 0.0002" in err and "resume: algorithm.kl_target: 6.0 -> 3.0" in err
    assert changed.s.config["trainer"]["lr"] == 2e-4  # what the next checkpoint records

    with pytest.raises(ValueError, match=r"model.dtype: 'float32' -> 'bfloat16'.*this policy"):
        build_trainer(toy_config(tmp_path / "run", model={"dtype": "bfloat16"}, trainer=base["trainer"],
                                 algorithm=algo), resume=True)
